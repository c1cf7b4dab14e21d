"""XGBoost as its docs show checkpointing: xgb.train(..., callbacks=[xgb.callback.TrainingCheckPoint(directory,
interval=K)]), which saves <directory>/model_<iteration>.ubj every K rounds; a restart passes the newest model as
xgb_model and trains the rounds left."""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import seam
import xgboost as xgb


class Report(xgb.callback.TrainingCallback):
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def after_iteration(self, model, epoch, evals_log):  # type: ignore[no-untyped-def]
        seam.progress(model.num_boosted_rounds(), evals_log["train"]["rmse"][-1])
        time.sleep(self.sleep)
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=0.05)
    a = ap.parse_args()
    if os.environ.get("ONBOX_TEST_DIE_AT", "").startswith("own-save"):
        real = xgb.Booster.save_model

        def save_model(self, fname):  # type: ignore[no-untyped-def]
            if seam.reached("own-save"):  # the bytes XGBoost writes, cut where a kill would cut them
                raw = bytes(self.save_raw("ubj"))
                with open(fname, "wb") as f:
                    f.write(raw[:len(raw) // 2])
                seam.die("own-save")
            real(self, fname)
        xgb.Booster.save_model = save_model  # type: ignore[method-assign]
    ckpt = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.random((400, 8))
    dtrain = xgb.DMatrix(x, label=x @ rng.random(8))
    model = None
    resume = os.environ.get("ONBOX_RESUME_FROM")
    if resume:
        model = xgb.Booster(model_file=resume)
        seam.resumed(model.num_boosted_rounds(), resume)
    done = model.num_boosted_rounds() if model is not None else 0
    xgb.train({"tree_method": "hist", "max_depth": 3, "nthread": 1}, dtrain, num_boost_round=a.rounds - done,
              evals=[(dtrain, "train")], verbose_eval=False, xgb_model=model,
              callbacks=[Report(a.sleep), xgb.callback.TrainingCheckPoint(directory=ckpt, interval=a.interval)])


if __name__ == "__main__":
    main()
