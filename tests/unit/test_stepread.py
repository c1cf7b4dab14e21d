"""The step a checkpoint records about itself, read from real torch.save files (zip and legacy) without running
their code: nanoGPT's iter_num, Lightning's global_step, HF's trainer_state.json, plain loops' keys."""
from __future__ import annotations

import collections
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

from onbox.checkpoints.formats import torchpickle
from onbox.checkpoints.formats.stepread import StepReading, step_of_dir, step_of_file
from tests.checkpoint_files import write_torch_zip
from tests.torch_checkpoints import lightning_checkpoint, nanogpt_checkpoint, save

torch = pytest.importorskip("torch")

FORMATS = pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])


@FORMATS
def test_nanogpt_ckpt_pt_iter_num(tmp_path, legacy):
    p = save(nanogpt_checkpoint(iter_num=60), str(tmp_path / "ckpt.pt"), legacy=legacy)
    assert step_of_file(p) == StepReading(60, "ckpt.pt:iter_num")


@FORMATS
def test_lightning_ckpt_global_step(tmp_path, legacy):
    p = save(lightning_checkpoint(global_step=120, epoch=3), str(tmp_path / "last.ckpt"), legacy=legacy,
             via_buffer=True)
    if not legacy:
        with zipfile.ZipFile(p) as zf:
            assert zf.namelist()[0].startswith("archive/")  # what Lightning's buffered save names its top dir
    assert step_of_file(p) == StepReading(120, "last.ckpt:global_step")


@FORMATS
@pytest.mark.parametrize("obj, want", [
    ({"step": 7, "model": {}}, (7, "step")),
    ({"iteration": 3}, (3, "iteration")),
    ({"iter": 2}, (2, "iter")),
    ({"step": 9, "global_step": 8, "iter_num": 7}, (8, "global_step")),  # the order of preference
    ({"iter_num": 5, "step": 6}, (5, "iter_num")),
    ({"global_steps": 40, "iteration": 40}, (40, "global_steps")),  # DeepSpeed's model-states file
    ({"step": True, "iteration": 4}, (4, "iteration")),  # a bool is not a step
    ({"step": 3.0}, None),
    ({"step": -1}, None),
    ({"epoch": 2}, None),
    ({"model": {"step": 5}}, None),  # nested (an optimizer's per-parameter step) does not count
    ([1, 2, 3], None),
])
def test_plain_dicts(tmp_path, legacy, obj, want):
    p = save(obj, str(tmp_path / "model.pt"), legacy=legacy)
    assert step_of_file(p) == (StepReading(want[0], "model.pt:" + want[1]) if want else None)


def test_a_tensor_step_is_skipped_and_an_ordered_dict_top_level_is_read(tmp_path):
    p = save({"step": torch.tensor(5), "iteration": 11}, str(tmp_path / "a.pt"))
    assert step_of_file(p) == StepReading(11, "a.pt:iteration")
    q = save(collections.OrderedDict([("w", torch.zeros(2)), ("step", 4)]), str(tmp_path / "b.pt"))
    assert step_of_file(q) == StepReading(4, "b.pt:step")


def test_what_has_no_readable_step_gives_none(tmp_path, monkeypatch):
    zero = tmp_path / "z.pt"
    zero.write_bytes(bytes(5632))
    text = tmp_path / "t.pt"
    text.write_text('{"step": 5}')
    st = tmp_path / "m.safetensors"
    st.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    good = save({"step": 5}, str(tmp_path / "g.pt"))
    cut = tmp_path / "cut.pt"
    cut.write_bytes(Path(good).read_bytes()[:-30])
    with zipfile.ZipFile(str(tmp_path / "bad.pt"), "w") as zf:  # a data.pkl that does not unpickle
        zf.writestr("bad/data.pkl", b"\x80\x02}q\x00(X\x04\x00\x00\x00stepK\x05\xff\xfe.")
        zf.writestr("bad/version", b"3\n")
    for p in (zero, text, st, cut, tmp_path / "bad.pt", tmp_path / "missing.pt"):
        assert step_of_file(str(p)) is None, p
    big = save({"step": 5, "blob": b"x" * 5000}, str(tmp_path / "big.pt"))  # data.pkl over the limit: not read
    big_legacy = save({"step": 5, "blob": b"x" * 5000}, str(tmp_path / "bigl.pt"), legacy=True)
    monkeypatch.setattr(torchpickle, "PICKLE_LIMIT", 4096)
    assert step_of_file(big) is None and step_of_file(big_legacy) is None
    assert step_of_file(good) == StepReading(5, "g.pt:step")


def test_reading_runs_no_code_and_imports_nothing(tmp_path):
    sentinel = tmp_path / "ran"
    cmd = ("touch %s" % sentinel).encode()
    evil = (b"\x80\x02}q\x00(X\x04\x00\x00\x00stepK\x07X\x01\x00\x00\x00xcos\nsystem\nX"
            + len(cmd).to_bytes(4, "little") + cmd + b"\x85RX\x01\x00\x00\x00ycbuiltins\nexec\n"
            b"X\x0b\x00\x00\x00import sys\n\x85RX\x01\x00\x00\x00zconboxtest_never_imported\nThing\n)\x81u.")
    with zipfile.ZipFile(str(tmp_path / "evil.pt"), "w") as zf:
        zf.writestr("evil/data.pkl", evil)
        zf.writestr("evil/version", b"3\n")
    assert step_of_file(str(tmp_path / "evil.pt")) == StepReading(7, "evil.pt:step")
    assert not sentinel.exists() and "onboxtest_never_imported" not in sys.modules


def test_hf_dir_reads_trainer_state(tmp_path):
    d = tmp_path / "checkpoint-40"
    save({"state": {}, "param_groups": []}, str(d / "optimizer.pt"))
    save({"last_epoch": 40, "_step_count": 41}, str(d / "scheduler.pt"))
    save({"python": (3, (1, 2), None), "cpu": torch.get_rng_state()}, str(d / "rng_state.pth"))
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 40, "epoch": 0.5, "log_history": []}))
    assert step_of_dir(str(d)) == StepReading(40, "trainer_state.json:global_step")
    (d / "trainer_state.json").write_text('{"global_step": 40, "log_hi')  # torn (HF writes it last)
    assert step_of_dir(str(d)) is None
    os.unlink(d / "trainer_state.json")  # killed before it: the torch files record no step either
    assert step_of_dir(str(d)) is None


def test_dir_of_torch_files(tmp_path):
    d = tmp_path / "epoch=0-step=50.ckpt"  # a sharded Lightning/DeepSpeed checkpoint: files one level down
    save({"global_steps": 50, "module": {}}, str(d / "checkpoint" / "mp_rank_00_model_states.pt"))
    save({"optimizer_state_dict": {}}, str(d / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    (d / "latest").write_text("checkpoint")
    assert step_of_dir(str(d)) == StepReading(50, "checkpoint/mp_rank_00_model_states.pt:global_steps")
    one = tmp_path / "fsdp"
    save({"global_step": 9, "epoch": 1}, str(one / "meta.pt"))
    (one / "__0_0.distcp").write_bytes(b"\x00" * 64)
    assert step_of_dir(str(one)) == StepReading(9, "meta.pt:global_step")
    save({"step": 10}, str(one / "other.pt"))  # two files that disagree: no honest single answer
    assert step_of_dir(str(one)) is None
    assert step_of_dir(str(tmp_path / "empty")) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_reading_the_step_of_a_large_ckpt_reads_the_directory_and_data_pkl_only(tmp_path):
    torch.manual_seed(0)
    p = save(nanogpt_checkpoint(iter_num=250, n_layer=4, n_embd=192, vocab=512, block=256), str(tmp_path / "ckpt.pt"))
    size = os.path.getsize(p)
    with zipfile.ZipFile(p) as zf:
        pkl = zf.getinfo("ckpt/data.pkl").file_size
    with open("/proc/self/io") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("rchar"))
    assert step_of_file(p) == StepReading(250, "ckpt.pt:iter_num")
    with open("/proc/self/io") as f:
        read = next(int(line.split()[1]) for line in f if line.startswith("rchar")) - before
    assert size > 20 * 1024 * 1024 and read < pkl + 64 * 1024, (read, pkl)  # a bound on bytes, not time


def test_a_fake_torch_zip_of_the_test_helpers_carries_a_step(tmp_path):
    # tests elsewhere write torch-shaped zips without torch; they can carry a step the same way
    p = write_torch_zip(str(tmp_path / "step_3.pt"), obj={"iter_num": 3})
    assert step_of_file(p) == StepReading(3, "step_3.pt:iter_num")


@pytest.mark.integration
def test_a_real_lightning_trainer_checkpoint(tmp_path):
    L = pytest.importorskip("lightning")

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ckpt], default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]
    for name in names:
        step = int(name.rpartition("=")[2].split(".")[0])
        assert step_of_file(str(tmp_path / "ck" / name)) == StepReading(step, name + ":global_step")
        assert torch.load(str(tmp_path / "ck" / name), weights_only=False)["global_step"] == step
