"""JAX + Flax + Optax with orbax-checkpoint's CheckpointManager, as the Flax and Orbax docs show: a TrainState saved
every --save-every steps with asynchronous saves (the manager writes `<step>.orbax-checkpoint-tmp*` and renames it
to `<step>/` when the save commits), restored at start from the manager's latest step.

--ballast-mb adds a parameter of that size, so each async save takes long enough for a preemption to land inside
it (the test waits for the tmp dir and stops the agent then)."""
from __future__ import annotations

import argparse
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import seam
from flax.training import train_state


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):  # type: ignore[no-untyped-def]
        return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.02)
    ap.add_argument("--ballast-mb", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.random((128, 8)), dtype=jnp.float32)
    y = x @ jnp.asarray(rng.random((8, 1)), dtype=jnp.float32)
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    ballast = jnp.zeros((a.ballast_mb * 1024 * 1024 // 4,), dtype=jnp.float32)
    mngr = ocp.CheckpointManager(os.environ["ONBOX_CKPT_DIR"], options=ocp.CheckpointManagerOptions(
        max_to_keep=3, save_interval_steps=a.save_every, enable_async_checkpointing=True))
    step = 0
    latest = mngr.latest_step()
    if latest is not None:
        restored = mngr.restore(latest, args=ocp.args.StandardRestore({"state": state, "ballast": ballast}))
        state, step = restored["state"], latest
        seam.resumed(step, os.path.join(os.environ["ONBOX_CKPT_DIR"], str(latest)))

    @jax.jit
    def train_step(state, x, y):  # type: ignore[no-untyped-def]
        def loss_fn(p):  # type: ignore[no-untyped-def]
            return jnp.mean((state.apply_fn(p, x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    while step < a.steps:
        state, loss = train_step(state, x, y)
        step += 1
        seam.progress(step, float(loss))
        mngr.save(step, args=ocp.args.StandardSave({"state": state, "ballast": ballast + step}))
        time.sleep(a.sleep)
    mngr.wait_until_finished()
    mngr.close()


if __name__ == "__main__":
    main()
