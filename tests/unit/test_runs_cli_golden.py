"""`onbox status` and `onbox ls` text output against golden files (tests/golden/runs/), and the --json documents
scripts read. After a deliberate change: UPDATE_GOLDEN=1 pytest tests/unit/test_runs_cli_golden.py, review the diff."""
from __future__ import annotations

import json

from click.testing import CliRunner

import onbox.commands.runs as cmd
from tests.golden import check_golden

T = 1_795_000_000.0  # a fixed wall time: the output has no clock-dependent figure
DEAD_PID = 2 ** 22 + 1  # above pid_max's ceiling: never a live process




def _run(home, name, state, progress=None, checkpoint=None):
    d = home / "runs" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"name": name, "command": ["python", "train.py"]}))
    (d / "state.json").write_text(json.dumps(dict({"run": name, "updated_at": T, "agent_pid": None}, **state)))
    if progress is not None:
        (d / "progress.json").write_text(json.dumps(progress))
    if checkpoint is not None:
        (d / "checkpoint_status.json").write_text(json.dumps(checkpoint))


def _runs(home):
    _run(home, "gpt2-small", {"state": "done", "attempt": 1, "restarts": 1, "child_pid": None,
                              "last_exit": {"classification": "success", "message": "exited with code 0"}},
         progress={"step": 5000, "loss": 2.91, "eval_loss": 3.02, "tokens_per_s": 181000.0},
         checkpoint={"latest_local": {"name": "ckpt.pt", "step": 5000},
                     "latest_durable": {"name": "ckpt.pt.step-5000", "step": 5000},
                     "last_sync": {"ok": True, "error": None}})
    _run(home, "llama-ft", {"state": "running", "attempt": 0, "restarts": 0, "child_pid": 4242,
                            "agent_pid": DEAD_PID, "agent_start_time": 1},
         progress={"step": 120, "loss": 1.75},
         checkpoint={"latest_local": {"name": "checkpoint-100", "step": 100}, "latest_durable": None,
                     "last_sync": {"ok": False, "error": "durable disk full: 1.2 GB free, 4.0 GB needed"}})
    _run(home, "oom-run", {"state": "failed", "attempt": 2, "restarts": 2, "child_pid": None,
                           "message": "crash loop: the same failure (cuda_oom) 3 times in a row; not restarting.",
                           "last_exit": {"classification": "cuda_oom", "message": "CUDA out of memory"}})


def test_status_text(onbox_home):
    _runs(onbox_home)
    r = CliRunner().invoke(cmd.status, [])
    assert r.exit_code == 0, r.output
    check_golden("runs/status.txt", r.output)
    one = CliRunner().invoke(cmd.status, ["llama-ft"])
    assert one.exit_code == 0 and one.output == r.output[r.output.index("llama-ft:"):r.output.index("oom-run:")]


def test_ls_text(onbox_home):
    _runs(onbox_home)
    r = CliRunner().invoke(cmd.ls, [])
    assert r.exit_code == 0, r.output
    check_golden("runs/ls.txt", r.output)


def test_json_documents_for_scripts(onbox_home):
    _runs(onbox_home)
    doc = json.loads(CliRunner().invoke(cmd.status, ["llama-ft", "--json"]).output)
    assert doc["state"] == "running" and doc["agent_alive"] is False and "onbox adopt llama-ft" in doc["note"]
    assert doc["progress"]["step"] == 120 and doc["checkpoint"]["last_sync"]["ok"] is False
    rows = json.loads(CliRunner().invoke(cmd.ls, ["--json"]).output)
    assert [(r["run"], r["state"], r["agent_alive"]) for r in rows] == [
        ("gpt2-small", "done", False), ("llama-ft", "running", False), ("oom-run", "failed", False)]
    everything = json.loads(CliRunner().invoke(cmd.status, ["--json"]).output)
    assert [d["run"] for d in everything] == ["gpt2-small", "llama-ft", "oom-run"]


def test_logs_refuses_a_negative_line_count(onbox_home):
    _runs(onbox_home)
    r = CliRunner().invoke(cmd.logs, ["gpt2-small", "-n", "-3"])
    assert r.exit_code == 2 and "-n" in r.output
