"""The sweep: bad inputs fed to the real `onbox` CLI, one subprocess each.

Every row states what a demanding user typed (argv, and where it matters the environment, a run file, a profile,
a damaged state file) and what must come back: the documented exit code, one line (`onbox: ...`, or click's
`Error: ...` for a malformed command line) carrying the substring, no traceback, and nothing half-written: the
sandbox (ONBOX_HOME and every file the row made) is byte for byte what it was, and no process was left behind.

Rows share nothing: each gets its own tmp dir and ONBOX_HOME, so the table runs in parallel under pytest-xdist.
Most rows are refused before anything starts; the whole table takes well under a minute on two cores.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Union

import pytest

from tests.conftest import subprocess_env
from tests.integration.supervisor_helpers import FAST
from tests.processes import kill_test_processes, pids_with_home

pytestmark = pytest.mark.integration
PY = sys.executable
CMD = ["--", "true"]


class Fifo(NamedTuple):
    """A named pipe at this path, with no writer: reading it the naive way blocks forever."""


class Link(NamedTuple):
    """A symlink at this path to `target` ({tmp} and {home} filled in)."""

    target: str


Content = Union[str, bytes, Fifo, Link]


class Row(NamedTuple):
    id: str
    argv: List[str]
    code: int
    msg: str
    env: Dict[str, str]
    files: Dict[str, Content]  # relative to the row's tmp dir ({home} is ONBOX_HOME)
    stdin: str


def row(id: str, argv: List[str], code: int, msg: str, env: Optional[Dict[str, str]] = None,
        files: Optional[Dict[str, Content]] = None, run: Optional[Dict[str, Any]] = None,
        state: Optional[Content] = None, stdin: str = "") -> Row:
    """`run`: a run named r exists with this config.json (merged over a minimal one); `state`: its state.json."""
    files = dict(files or {})
    if run is not None or state is not None:
        cfg = {"name": "r", "command": ["true"]}
        cfg.update(run or {})
        files["home/runs/r/config.json"] = json.dumps(cfg)
    if state is not None:
        files["home/runs/r/state.json"] = state
    return Row(id, argv, code, msg, env or {}, files, stdin)


def run_file(body: str) -> Dict[str, Content]:
    return {"run.toml": body}


def profile(body: Content) -> Dict[str, Content]:
    return {"home/profiles/local.toml": body}


RUNNING = json.dumps({"run": "r", "state": "running", "attempt": 0, "child_pid": None, "agent_pid": None})
F = "{tmp}/run.toml"
SIGNALS = [
    ("preempt-KILL", ["--preempt-signal", "KILL"], "cannot be caught"),
    ("preempt-SIGKILL", ["--preempt-signal", "SIGKILL"], "cannot be caught"),
    ("preempt-9", ["--preempt-signal", "9"], "cannot be caught"),
    ("preempt-STOP", ["--preempt-signal", "STOP"], "cannot be caught"),
    ("preempt-sigstop-lower", ["--preempt-signal", "sigstop"], "cannot be caught"),
    ("preempt-19", ["--preempt-signal", "19"], "cannot be caught"),
    ("preempt-CHLD", ["--preempt-signal", "CHLD"], "preempt-signal"),
    ("preempt-bogus", ["--preempt-signal", "BOGUS"], "unknown signal"),
    ("preempt-empty", ["--preempt-signal", ""], "unknown signal"),
    ("preempt-0", ["--preempt-signal", "0"], "unknown signal"),
    ("preempt-999", ["--preempt-signal", "999"], "unknown signal"),
    ("preempt-minus1", ["--preempt-signal=-1"], "unknown signal"),
    ("preempt-two", ["--preempt-signal", "USR1 USR2"], "unknown signal"),
    ("ckpt-KILL", ["--checkpoint-signal", "KILL"], "cannot be caught"),
    ("ckpt-STOP", ["--checkpoint-signal", "STOP"], "cannot be caught"),
    ("ckpt-9", ["--checkpoint-signal", "9"], "cannot be caught"),
    ("ckpt-SIGSTOP", ["--checkpoint-signal", "SIGSTOP"], "cannot be caught"),
    ("ckpt-bogus", ["--checkpoint-signal", "NOPE"], "unknown signal"),
    ("ckpt-0", ["--checkpoint-signal", "0"], "unknown signal"),
    ("ckpt-65", ["--checkpoint-signal", "65"], "unknown signal"),
]
NUMBERS = [  # (flag, value, what the message names)
    ("--grace", "nan", "--grace"), ("--grace", "inf", "--grace"), ("--grace", "-inf", "--grace"),
    ("--grace", "-1", "--grace"), ("--grace", "1e308", "--grace"), ("--grace", "1e9", "--grace"),
    ("--grace", "abc", "--grace"),
    ("--sync-interval", "nan", "--sync-interval"), ("--sync-interval", "inf", "--sync-interval"),
    ("--sync-interval", "-5", "--sync-interval"), ("--sync-interval", "1e308", "--sync-interval"),
    ("--settle-seconds", "nan", "--settle-seconds"), ("--settle-seconds", "-1", "--settle-seconds"),
    ("--heartbeat-interval", "inf", "--heartbeat-interval"), ("--heartbeat-interval", "nan", "--heartbeat-interval"),
    ("--heartbeat-interval", "0", "--heartbeat-interval"), ("--heartbeat-interval", "-1", "--heartbeat-interval"),
    ("--heartbeat-interval", "1e12", "--heartbeat-interval"),
    ("--final-sync-timeout", "nan", "--final-sync-timeout"), ("--final-sync-timeout", "-1", "--final-sync-timeout"),
    ("--final-sync-timeout", "inf", "--final-sync-timeout"),
    ("--max-restarts", "-1", "--max-restarts"), ("--max-restarts", str(10 ** 30), "--max-restarts"),
    ("--max-restarts", "1.5", "--max-restarts"), ("--max-restarts", "x", "--max-restarts"),
    ("--keep-last", "-1", "--keep-last"), ("--keep-last", "1000000000", "--keep-last"),
    ("--keep-every", "0", "--keep-every"), ("--keep-every", "-5", "--keep-every"),
    ("--keep-every", "1e3", "--keep-every"),
]
RUN_FILE = [  # (id, [run] body, message)
    ("rf-max-restarts-true", "max_restarts = true", "max_restarts"),
    ("rf-keep-last-false", "keep_last = false", "keep_last"),
    ("rf-prune-local-1", "prune_local = 1", "prune_local"),
    ("rf-reap-orphans-str", "reap_orphans = 'maybe'", "reap_orphans"),
    ("rf-grace-nan", "grace = nan", "--grace"),
    ("rf-grace-inf", "grace = inf", "--grace"),
    ("rf-sync-minus-inf", "sync_interval = -inf", "--sync-interval"),
    ("rf-heartbeat-1e400", "heartbeat_interval = 1e400", "--heartbeat-interval"),
    ("rf-keep-last-1.5", "keep_last = 1.5", "keep_last"),
    ("rf-max-restarts-inf", "max_restarts = inf", "max_restarts"),
    ("rf-max-restarts-nan", "max_restarts = nan", "max_restarts"),
    ("rf-max-restarts-1e30", "max_restarts = 1e30", "max-restarts"),
    ("rf-restart-5", "restart = 5", "restart"),
    ("rf-restart-true", "restart = true", "restart"),
    ("rf-env-string", "env = 'A=1'", "env"),
    ("rf-env-list-value", "env = {A = [1, 2]}", "env"),
    ("rf-env-bool-value", "env = {A = true}", "env"),
    ("rf-command-int", "command = 5", "command"),
    ("rf-command-nul", 'command = ["echo", "a\\u0000b"]', "NUL"),
    ("rf-command-quote", "command = \"python 'unterminated\"", "command"),
    ("rf-name-slash", "name = 'bad/name'", "invalid run name"),
    ("rf-name-int", "name = 5", "name"),
    ("rf-durable-bool", "durable = true", "durable"),
    ("rf-notice-moon", "notice_source = 'moon'", "notice-source"),
    ("rf-best-mode", "keep_best_mode = 'sideways'", "keep_best_mode"),
    ("rf-tick-0", "tick_interval = 0", "tick_interval"),
    ("rf-notice-interval-0", "notice_interval = 0", "notice_interval"),
    ("rf-log-max-bytes-neg", "log_max_bytes = -1", "log_max_bytes"),
    ("rf-log-backups-huge", "log_backups = 100000", "log_backups"),
    ("rf-crash-loop-neg", "crash_loop_threshold = -1", "crash_loop_threshold"),
    ("rf-stall-0", "stall_minutes = 0", "stall_minutes"),
    ("rf-metrics-hint-neg", "metrics_hint_minutes = -1", "metrics_hint_minutes"),
    ("rf-log-tail-huge", "log_tail_lines = 201", "log_tail_lines"),
    ("rf-log-tail-float", "log_tail_lines = 2.5", "log_tail_lines"),
    ("rf-env-files-int", "env_files = 5", "env_files"),
    ("rf-secrets-dotdot", "secrets = ['../x']", "secret"),
    ("rf-requeue-maybe", "requeue = 'maybe'", "requeue"),
    ("rf-resume-bool", "resume_args = [true]", "resume_args"),
    ("rf-gpu-devices-int", "gpu_devices = 5", "gpu_devices"),
    ("rf-metrics-regex-bad", "metrics_regex = ['(']", "regular expression"),
    ("rf-preempt-KILL", "preempt_signal = 'KILL'", "cannot be caught"),
    ("rf-checkpoint-9", "checkpoint_signal = 9", "cannot be caught"),
    ("rf-unknown-key", "restrat = 'always'", "unknown key"),
    ("rf-backoff-nan", "backoff_initial = nan", "backoff_initial"),
    ("rf-reap-wait-inf", "reap_wait = inf", "reap_wait"),
]
ENVIRONMENT = [  # (id, variable, value, message)
    ("env-grace-nan", "ONBOX_GRACE", "nan", "--grace"),
    ("env-sync-inf", "ONBOX_SYNC_INTERVAL", "inf", "--sync-interval"),
    ("env-heartbeat-neg", "ONBOX_HEARTBEAT_INTERVAL", "-1", "--heartbeat-interval"),
    ("env-max-restarts-abc", "ONBOX_MAX_RESTARTS", "abc", "max_restarts"),
    ("env-max-restarts-true", "ONBOX_MAX_RESTARTS", "true", "max_restarts"),
    ("env-prune-maybe", "ONBOX_PRUNE_LOCAL", "maybe", "prune_local"),
    ("env-tick-0", "ONBOX_TICK_INTERVAL", "0", "tick_interval"),
    ("env-restart-sometimes", "ONBOX_RESTART", "sometimes", "restart"),
    ("env-keep-last-1e3", "ONBOX_KEEP_LAST", "1e3", "keep_last"),
    ("env-grace-huge", "ONBOX_GRACE", "1e308", "--grace"),
    ("env-term-timeout-neg", "ONBOX_TERM_TIMEOUT", "-0.5", "term_timeout"),
    ("env-notice-moon", "ONBOX_NOTICE_SOURCE", "moon", "notice-source"),
    ("env-preempt-KILL", "ONBOX_PREEMPT_SIGNAL", "KILL", "cannot be caught"),
    ("env-checkpoint-STOP", "ONBOX_CHECKPOINT_SIGNAL", "STOP", "cannot be caught"),
    ("env-metadata-url", "ONBOX_METADATA_URL", "notaurl", "--metadata-url"),
    ("env-tracker-url", "ONBOX_TRACKER", "notaurl", "--tracker"),
    ("env-metrics-regex", "ONBOX_METRICS_REGEX", "(", "regular expression"),
    ("env-notice-interval-nan", "ONBOX_NOTICE_INTERVAL", "nan", "notice_interval"),
    ("env-log-backups-neg", "ONBOX_LOG_BACKUPS", "-3", "log_backups"),
    ("env-stall-inf", "ONBOX_STALL_MINUTES", "inf", "stall_minutes"),
]

ROWS: List[Row] = []
ROWS += [row("run-" + i, ["run", "--name", "x", *a, *CMD], 2, m) for i, a, m in SIGNALS]
ROWS += [row("run-num%s%s" % (f, v), ["run", "--name", "x", f, v, *CMD], 2, m) for f, v, m in NUMBERS]
# A higher layer wins over the run file (and the sweep's fast knobs come from ONBOX_* variables): these rows give
# the run file the last word on the key they break, so the bad value is the one that counts.
UNSET_FAST = {k: "" for k in FAST}
OWN_WORD = {"rf-name-slash": ["run", "-f", F, *CMD], "rf-name-int": ["run", "-f", F, *CMD],
            "rf-command-nul": ["run", "-f", F], "rf-command-int": ["run", "-f", F],
            "rf-command-quote": ["run", "-f", F]}
ROWS += [row(i, OWN_WORD.get(i, ["run", "--name", "x", "-f", F, *CMD]), 2, m, env=UNSET_FAST,
             files=run_file("[run]\n%s\n" % body)) for i, body, m in RUN_FILE]
ROWS += [row(i, ["run", "--name", "x", *CMD], 2, m, env={var: value}) for i, var, value, m in ENVIRONMENT]
ROWS += [
    row("run-env-preempt-via-env-and-flag-ok-but-grace-bad", ["run", "--name", "x", "--preempt-signal", "USR2",
                                                              "--grace", "nan", *CMD], 2, "--grace"),
    row("run-keep-best-empty", ["run", "--name", "x", "--keep-best", "", *CMD], 2, "--keep-best"),
    row("run-keep-best-sideways", ["run", "--name", "x", "--keep-best", "loss:sideways", *CMD], 2, "--keep-best"),
    row("run-keep-best-colon-min", ["run", "--name", "x", "--keep-best", ":min", *CMD], 2, "--keep-best"),
    row("run-restart-choice", ["run", "--name", "x", "--restart", "sometimes", *CMD], 2, "--restart"),
    row("run-notice-choice", ["run", "--name", "x", "--notice-source", "moon", *CMD], 2, "--notice-source"),
    row("run-metadata-notaurl", ["run", "--name", "x", "--notice-source", "aws", "--metadata-url", "notaurl", *CMD],
        2, "--metadata-url"),
    row("run-metadata-ftp", ["run", "--name", "x", "--notice-source", "gcp", "--metadata-url", "ftp://x", *CMD],
        2, "--metadata-url"),
    row("run-metadata-nohost", ["run", "--name", "x", "--notice-source", "azure", "--metadata-url", "http://", *CMD],
        2, "--metadata-url"),
    row("run-metadata-badport", ["run", "--name", "x", "--metadata-url", "http://127.0.0.1:99999", *CMD],
        2, "--metadata-url"),
    row("run-metadata-auto-notaurl", ["run", "--name", "x", "--metadata-url", "notaurl", *CMD], 2, "--metadata-url"),
    row("run-tracker-notaurl", ["run", "--name", "x", "--tracker", "notaurl", *CMD], 2, "--tracker"),
    row("run-tracker-ftp", ["run", "--name", "x", "--tracker", "ftp://x", *CMD], 2, "http(s)"),
    row("run-tracker-nohost", ["run", "--name", "x", "--tracker", "http://:80", *CMD], 2, "--tracker"),
    row("run-tracker-notoken", ["run", "--name", "x", "--tracker", "http://127.0.0.1:9", *CMD], 2, "needs a token"),
    row("run-tracker-token-missing", ["run", "--name", "x", "--tracker", "http://127.0.0.1:9",
                                      "--tracker-token-file", "{tmp}/nope", *CMD], 2, "token file"),
    row("run-ping-notaurl", ["run", "--name", "x", "--ping-url", "notaurl", *CMD], 2, "--ping-url"),
    row("run-mlflow-ftp", ["run", "--name", "x", "--mlflow", "ftp://x", *CMD], 2, "--mlflow"),
    row("run-mlflow-password-in-url", ["run", "--name", "x", "--mlflow", "http://u:pw@127.0.0.1:9", *CMD], 2,
        "carries credentials"),
    row("run-mlflow-env-notaurl", ["run", "--name", "x", *CMD], 2, "--mlflow", env={"ONBOX_MLFLOW": "notaurl"}),
    row("run-mlflow-experiment-blank", ["run", "--name", "x", "--mlflow", "http://127.0.0.1:9",
                                        "--mlflow-experiment", " ", *CMD], 2, "--mlflow-experiment"),
    row("run-mlflow-token-missing", ["run", "--name", "x", "--mlflow", "http://127.0.0.1:9",
                                     "--mlflow-token-file", "{tmp}/nope", *CMD], 2, "MLflow token file"),
    row("run-mlflow-token-empty", ["run", "--name", "x", "--mlflow", "http://127.0.0.1:9",
                                   "--mlflow-token-file", "{tmp}/empty", *CMD], 2, "is empty",
        files={"empty": "\n"}),
    row("run-env-noeq", ["run", "--name", "x", "--env", "NOEQ", *CMD], 2, "--env"),
    row("run-env-emptyname", ["run", "--name", "x", "--env", "=v", *CMD], 2, "--env"),
    row("run-env-agent-token", ["run", "--name", "x", "--env", "ONBOX_TRACKER_TOKEN=s", *CMD], 2, "agent's secret"),
    row("run-env-space-name", ["run", "--name", "x", "--env", "A B=1", *CMD], 2, "environment variable name"),
    row("run-env-file-missing", ["run", "--name", "x", "--env-file", "{tmp}/nope.env", *CMD], 2, "--env-file"),
    row("run-env-file-dir", ["run", "--name", "x", "--env-file", "{tmp}", *CMD], 2, "--env-file"),
    row("run-env-file-badline", ["run", "--name", "x", "--env-file", "{tmp}/a.env", *CMD], 2, "line 2",
        files={"a.env": "A=1\nJUSTTEXT\n"}),
    row("run-env-file-noname", ["run", "--name", "x", "--env-file", "{tmp}/a.env", *CMD], 2, "line 1",
        files={"a.env": "=x\n"}),
    row("run-env-file-agent-token", ["run", "--name", "x", "--env-file", "{tmp}/a.env", *CMD], 2, "agent's secret",
        files={"a.env": "ONBOX_TRACKER_TOKEN=x\n"}),
    row("run-env-file-nul", ["run", "--name", "x", "--env-file", "{tmp}/a.env", *CMD], 2, "NUL",
        files={"a.env": b"A=b\x00c\n"}),
    row("run-env-file-quote", ["run", "--name", "x", "--env-file", "{tmp}/a.env", *CMD], 2, "line 1",
        files={"a.env": 'A="abc\n'}),
    row("run-env-file-binary", ["run", "--name", "x", "--env-file", "{tmp}/a.env", *CMD], 2, "--env-file",
        files={"a.env": b"\xff\xfeA=1\n"}),
    row("run-secret-missing", ["run", "--name", "x", "--secret", "HF_TOKEN", *CMD], 2, "no secret"),
    row("run-secret-dotdot", ["run", "--name", "x", "--secret", "../etc/passwd", *CMD], 2, "secret"),
    row("run-secret-empty-name", ["run", "--name", "x", "--secret", "A=", *CMD], 2, "secret"),
    row("run-secret-bad-var", ["run", "--name", "x", "--secret", "1BAD=tok", *CMD], 2, "environment variable name",
        files={"home/secrets/tok": "v\n"}),
    row("run-secret-empty-file", ["run", "--name", "x", "--secret", "HF_TOKEN", *CMD], 2, "empty",
        files={"home/secrets/HF_TOKEN": ""}),
    row("run-secret-agent-token", ["run", "--name", "x", "--secret", "ONBOX_TRACKER_TOKEN", *CMD], 2,
        "agent's secret", files={"home/secrets/ONBOX_TRACKER_TOKEN": "x\n"}),
    row("run-secret-dir", ["run", "--name", "x", "--secret", "HF_TOKEN", *CMD], 2, "secret",
        files={"home/secrets/HF_TOKEN/x": "v"}),
    row("run-regex-unbalanced", ["run", "--name", "x", "--metrics-regex", "(", *CMD], 2, "regular expression"),
    row("run-regex-nogroups", ["run", "--name", "x", "--metrics-regex", r"step \d+", *CMD], 2, "named group"),
    row("run-regex-unknown-group", ["run", "--name", "x", "--metrics-regex", r"(?P<foo>\d+)", *CMD], 2,
        "named group"),
    row("run-regex-empty", ["run", "--name", "x", "--metrics-regex", "", *CMD], 2, "named group"),
    row("run-name-slash", ["run", "--name", "bad/name", *CMD], 2, "invalid run name"),
    row("run-name-empty", ["run", "--name", "", *CMD], 2, "invalid run name"),
    row("run-name-long", ["run", "--name", "a" * 200, *CMD], 2, "invalid run name"),
    row("run-name-dot", ["run", "--name", ".hidden", *CMD], 2, "invalid run name"),
    row("run-workdir-missing", ["run", "--name", "x", "--workdir", "{tmp}/nope", *CMD], 2, "working directory"),
    row("run-workdir-file", ["run", "--name", "x", "--workdir", "{tmp}/afile", *CMD], 2, "--workdir",
        files={"afile": "x"}),
    row("run-no-command", ["run", "--name", "x"], 2, "no command"),
    row("run-cmd-not-found", ["run", "--name", "x", "--", "no-such-command-xyz"], 2, "not found on PATH"),
    row("run-cmd-not-exec", ["run", "--name", "x", "--", "{tmp}/script.sh"], 2, "executable",
        files={"script.sh": "echo hi\n"}),
    row("run-cmd-empty", ["run", "--name", "x", "--", ""], 2, "cannot run"),
    row("run-ckpt-under-file", ["run", "--name", "x", "--ckpt-dir", "{tmp}/afile/sub", *CMD], 3, "checkpoint dir",
        files={"afile": "x"}),
    row("run-durable-under-file", ["run", "--name", "x", "--durable", "{tmp}/afile/sub", *CMD], 3, "durable",
        files={"afile": "x"}),
    row("run-heartbeat-file-under-file", ["run", "--name", "x", "--heartbeat-file", "{tmp}/afile/hb.jsonl", *CMD], 3,
        "heartbeat file", files={"afile": "x"}),
    row("run-rclone-missing", ["run", "--name", "x", "--durable", "remote:bucket", "--", PY, "-c", "0"], 3, "rclone",
        env={"PATH": "/nonexistent"}),
    row("run-profile-unknown", ["run", "--name", "x", "--profile", "nosuch", *CMD], 2, "nosuch"),
    row("run-profile-dotdot", ["run", "--name", "x", "--profile", "../x", *CMD], 2, "profile"),
    row("run-profile-grace-nan", ["run", "--name", "x", "--profile", "local", *CMD], 2, "grace_seconds",
        files=profile("[preemption]\ngrace_seconds = nan\n")),
    row("run-profile-max-restarts-true", ["run", "--name", "x", "--profile", "local", *CMD], 2, "max_restarts",
        files=profile("[run]\nmax_restarts = true\n")),
    row("run-profile-preempt-KILL", ["run", "--name", "x", "--profile", "local", *CMD], 2, "cannot be caught",
        files=profile("[run]\npreempt_signal = 'KILL'\n")),
    row("run-profile-bad-toml", ["run", "--name", "x", "--profile", "local", *CMD], 2, "not valid TOML",
        files=profile("[run\n")),
    row("run-profile-heartbeat-inf", ["run", "--name", "x", "--profile", "local", *CMD], 2, "--heartbeat-interval",
        files=profile("[run]\nheartbeat_interval = inf\n")),
    row("run-file-missing", ["run", "--name", "x", "-f", "{tmp}/nope.toml", *CMD], 2, "run file"),
    row("run-file-dir", ["run", "--name", "x", "-f", "{tmp}", *CMD], 2, "directory"),
    row("run-file-bad-toml", ["run", "--name", "x", "-f", F, *CMD], 2, "not valid TOML", files=run_file("[run\n")),
    row("run-file-run-not-table", ["run", "--name", "x", "-f", F, *CMD], 2, "must be a table",
        files=run_file("run = 5\n")),
    row("run-file-latin1", ["run", "--name", "x", "-f", F, *CMD], 2, "UTF-8",
        files=run_file(b"[run]\nname = '\xe9'\n")),  # type: ignore[arg-type]
    row("run-file-empty-command-list", ["run", "--name", "x", "-f", F], 2, "no command",
        files=run_file("[run]\ncommand = []\n")),
    row("run-home-is-file", ["run", "--name", "x", *CMD], 2, "not writable",
        env={"ONBOX_HOME": "{tmp}/afile"}, files={"afile": "x"}),
    row("run-unknown-option", ["run", "--bogus", *CMD], 2, "--bogus"),
    row("relaunch-corrupt-config", ["run", "--name", "r"], 2, "re-launch record",
        files={"home/runs/r/config.json": "{nope"}),
    row("relaunch-config-list", ["run", "--name", "r"], 2, "not a JSON object",
        files={"home/runs/r/config.json": "[]"}),
    row("relaunch-config-grace-nan", ["run", "--name", "r"], 2, "--grace",
        files={"home/runs/r/config.json": '{"name": "r", "command": ["true"], "grace": NaN}'}),
    row("relaunch-config-preempt-KILL", ["run", "--name", "r"], 2, "cannot be caught", run={"preempt_signal": "KILL"}),
    row("relaunch-config-max-restarts-true", ["run", "--name", "r"], 2, "max_restarts", run={"max_restarts": True}),
    row("relaunch-config-unknown-key", ["run", "--name", "r"], 2, "unknown key", run={"bogus": 1}),
    row("relaunch-config-heartbeat-inf", ["run", "--name", "r"], 2, "--heartbeat-interval",
        files={"home/runs/r/config.json": '{"name": "r", "command": ["true"], "heartbeat_interval": Infinity}'}),
    row("relaunch-config-secret-gone", ["run", "--name", "r"], 2, "no secret", run={"secrets": ["HF_TOKEN"]}),
]
GROUP = '{"schema": "onbox.node_group/1", "group": "0123456789abcdef", "run": "x", "rank": 5, "nnodes": 2}'
ROWS += [  # containers and multi-node groups
    row("run-docker-dash-image", ["run", "--name", "x", "--docker=-v", *CMD], 2, "image name"),
    row("run-docker-shm-size", ["run", "--name", "x", "--docker", "img", "--shm-size", "lots", *CMD], 2, "--shm-size"),
    row("run-docker-detached-client", ["run", "--name", "x", "--", "docker", "run", "-d", "img", "true"], 2,
        "detaches"),
    row("run-docker-twice", ["run", "--name", "x", "--docker", "img", "--", "docker", "run", "img", "true"], 2,
        "builds the"),
    row("run-node-group-missing", ["run", "--name", "x", "--node-group", "{tmp}/nope.json", *CMD], 2,
        "cannot read the node group"),
    row("run-node-group-stdin-garbage", ["run", "--name", "x", "--node-group", "-", *CMD], 2, "not JSON",
        stdin="{oops"),
    row("run-node-group-stdin-rank", ["run", "--name", "x", "--node-group", "-", *CMD], 2, "key", stdin=GROUP),
]
CORRUPT = [("not-json", "{not json"), ("list", "[]"), ("state-int", '{"state": 5}'), ("empty", ""),
           ("state-unknown", '{"state": "exploded"}'), ("binary", b"\x00\xff\x00")]
ROWS += [row("status-corrupt-" + i, ["status", "r"], 2, "corrupt", state=s) for i, s in CORRUPT]
ROWS += [
    row("status-corrupt-json", ["status", "r", "--json"], 2, "corrupt", state="{oops"),
    row("status-all-corrupt", ["status"], 2, "corrupt", state="{oops"),
    row("stop-corrupt", ["stop", "r"], 2, "corrupt", state="{oops"),
    row("status-nosuch", ["status", "nosuch"], 2, "no run named"),
    row("status-dotdot", ["status", "../x"], 2, "invalid run name"),
    row("logs-nosuch", ["logs", "nosuch"], 2, "no run named"),
    row("logs-dotdot", ["logs", "../etc"], 2, "invalid run name"),
    row("logs-n-negative", ["logs", "r", "-n", "-1"], 2, "-n", run={}),
    row("logs-n-abc", ["logs", "r", "-n", "abc"], 2, "-n", run={}),
    row("stop-nosuch", ["stop", "nosuch"], 2, "no run named"),
    row("stop-grace-nan", ["stop", "r", "--grace", "nan"], 2, "--grace", state=RUNNING),
    row("stop-grace-neg", ["stop", "r", "--grace", "-1"], 2, "--grace", state=RUNNING),
    row("stop-grace-inf", ["stop", "r", "--grace", "inf"], 2, "--grace", state=RUNNING),
    row("stop-grace-huge", ["stop", "r", "--grace", "1e308"], 2, "--grace", state=RUNNING),
    row("stop-grace-abc", ["stop", "r", "--grace", "abc"], 2, "--grace", state=RUNNING),
    row("stop-grace-nan-stopped", ["stop", "r", "--grace", "nan"], 2, "--grace",
        state=json.dumps({"run": "r", "state": "stopped"})),
    row("stop-timeout-and-no-wait", ["stop", "r", "--timeout", "5", "--no-wait"], 2, "--timeout and --no-wait",
        state=RUNNING),
    # the old spelling of --timeout: read as it, with a warning
    row("stop-old-wait-and-no-wait", ["stop", "r", "--wait", "5", "--no-wait"], 2, "--timeout and --no-wait",
        state=RUNNING),
    row("adopt-nosuch", ["adopt", "nosuch"], 2, "no run named"),
    row("adopt-dotdot", ["adopt", "../x"], 2, "invalid run name"),
    row("adopt-no-child", ["adopt", "r"], 2, "no live child", state=RUNNING),
    row("adopt-corrupt-config", ["adopt", "r"], 2, "config.json", files={"home/runs/r/config.json": "{nope"}),
    row("adopt-config-KILL", ["adopt", "r"], 2, "cannot be caught", run={"preempt_signal": "KILL"}),
]
HOME_IS_FILE = {"env": {"ONBOX_HOME": "{tmp}/afile"}, "files": {"afile": "x"}}
ROWS += [row("home-file-" + "-".join(a), list(a), 2, "not a directory", **HOME_IS_FILE)  # type: ignore[arg-type]
         for a in (["status"], ["status", "r"], ["ls"], ["logs", "r"], ["stop", "r"], ["adopt", "r"],
                   ["status", "--json"], ["ls", "--json"])]
ROWS += [
    row("home-under-file-status", ["status"], 2, "not a directory", env={"ONBOX_HOME": "{tmp}/afile/home"},
        files={"afile": "x"}),
    row("home-runs-is-file-status", ["status"], 2, "not a directory", files={"home/runs": "x"}),
    row("home-runs-is-file-ls", ["ls"], 2, "not a directory", files={"home/runs": "x"}),
]
SB = ["sbatch", "--print"]
TIMES = ["garbage", "", "-5", "1-", "1-2-3", "1:2:3:4", "5m", "1.5", "abc:00", "1:", ":30", "1-2:3:4:5", "٣"]
ROWS += [row("sbatch-time-%r" % t, [*SB, "--time", t, *CMD], 2, "--time") for t in TIMES]
ROWS += [
    row("sbatch-time-shorter-than-lead", [*SB, "--time", "1", *CMD], 2, "--signal-lead"),
    row("sbatch-nodes-0", [*SB, "--nodes", "0", *CMD], 2, "--nodes"),
    row("sbatch-nodes-neg", [*SB, "--nodes", "-1", *CMD], 2, "--nodes"),
    row("sbatch-lead-0", [*SB, "--signal-lead", "0", *CMD], 2, "--signal-lead"),
    row("sbatch-lead-huge", [*SB, "--signal-lead", "70000", *CMD], 2, "--signal-lead"),
    row("sbatch-signal-KILL", [*SB, "--signal", "KILL", *CMD], 2, "cannot be caught"),
    row("sbatch-signal-bogus", [*SB, "--signal", "BOGUS", *CMD], 2, "unknown signal"),
    row("sbatch-arg-nodash", [*SB, "--sbatch-arg", "nodash", *CMD], 2, "not an sbatch option"),
    row("sbatch-agent-quote", [*SB, "--agent", "'unterminated", *CMD], 2, "--agent"),
    row("sbatch-no-command", [*SB], 2, "no command"),
    row("sbatch-preempt-signal", [*SB, "--preempt-signal", "USR2", *CMD], 2, "--preempt-signal"),
    row("sbatch-foreground", [*SB, "--foreground", *CMD], 2, "--foreground"),
    row("sbatch-run-grace-nan", [*SB, "--time", "4:00:00", "--grace", "nan", *CMD], 2, "--grace"),
    row("sbatch-run-unknown-option", [*SB, "--bogus-option", "1", *CMD], 2, "--bogus-option"),
    row("sbatch-missing", ["sbatch", "--time", "10", *CMD], 3, "sbatch", env={"PATH": "/nonexistent"}),
    row("profiles-show-nosuch", ["profiles", "show", "nosuch"], 2, "nosuch"),
    row("profiles-show-dotdot", ["profiles", "show", "../x"], 2, "profile"),
    row("profiles-detect-nosuch", ["profiles", "detect", "--profile", "nosuch"], 2, "nosuch"),
    row("audit-min-free-gb-nan", ["audit", "--min-free-gb", "nan"], 2, "--min-free-gb"),
    row("audit-min-free-gb-inf", ["audit", "--min-free-gb", "inf"], 2, "--min-free-gb"),
    row("audit-min-free-gb-neg", ["audit", "--min-free-gb", "-1"], 2, "--min-free-gb"),
    row("audit-min-free-inodes-neg", ["audit", "--min-free-inodes", "-5"], 2, "--min-free-inodes"),
    row("audit-profile-nosuch", ["audit", "--profile", "nosuch"], 2, "nosuch"),
    row("reap-min-age-nan", ["reap", "--min-age", "nan"], 2, "--min-age"),
    row("reap-min-age-neg", ["reap", "--min-age", "-1"], 2, "--min-age"),
    row("reap-term-timeout-inf", ["reap", "--term-timeout", "inf"], 2, "--term-timeout"),
    row("verify-missing", ["verify", "{tmp}/nope"], 2, "nope"),
    row("checkpoints-nosuch", ["checkpoints", "nosuch"], 2, "nosuch"),
    row("checkpoints-no-run", ["checkpoints", "--json"], 2, "give a run NAME or --all, not neither"),
    row("checkpoints-run-and-all", ["checkpoints", "r", "--all"], 2, "give a run NAME or --all, not both"),
    row("checkpoints-all-durable", ["checkpoints", "--all", "--durable", "{tmp}"], 2, "not with --all"),
    row("sync-nosuch", ["sync", "nosuch", "--now"], 2, "nosuch"),
    row("unknown-command", ["frobnicate"], 2, "No such command"),
]

DEEP = "[" * 50000 + "]" * 50000  # past every recursion limit: a RecursionError where nothing bounds the nesting
DEEP_JSON = "[" * 100000 + "]" * 100000
ZERO, FIFO = Link("/dev/zero"), Fifo()
TRACKER = ["--tracker", "http://127.0.0.1:9", "--tracker-token-file"]
MLFLOW = ["--mlflow", "http://127.0.0.1:9", "--mlflow-token-file"]
ROWS += [  # issue 19: unbounded and hostile reads (a FIFO row must end at once, not at the 60 s timeout)
    row("read-run-file-dev-zero", ["run", "--name", "x", "-f", "/dev/zero", *CMD], 2, "character device"),
    row("read-run-file-fifo", ["run", "--name", "x", "-f", F, *CMD], 2, "FIFO", files={"run.toml": FIFO}),
    row("read-run-file-link-dev-zero", ["run", "--name", "x", "-f", F, *CMD], 2, "character device",
        files={"run.toml": ZERO}),
    row("read-run-file-too-large", ["run", "--name", "x", "-f", F, *CMD], 2, "too large",
        files=run_file("# " + "x" * (5 << 20) + "\n")),
    row("read-run-file-deep-50000", ["run", "--name", "x", "-f", F, *CMD], 2, "nests too deeply",
        files=run_file("[run]\nx = %s\n" % DEEP)),
    row("read-run-file-deep-100", ["run", "--name", "x", "-f", F, *CMD], 2, "nests more than 64 levels",
        files=run_file("[run]\nx = %s%s\n" % ("[" * 100, "]" * 100))),
    row("read-profile-link-dev-zero", ["run", "--name", "x", "--profile", "local", *CMD], 2, "character device",
        files=profile(ZERO)),
    row("read-profile-fifo", ["run", "--name", "x", "--profile", "local", *CMD], 2, "FIFO",
        files=profile(FIFO)),
    row("read-profile-too-large", ["run", "--name", "x", "--profile", "local", *CMD], 2, "too large",
        files=profile("# " + "x" * (5 << 20) + "\n")),
    row("read-profile-deep", ["run", "--name", "x", "--profile", "local", *CMD], 2, "nests too deeply",
        files=profile("[run]\nenv = %s\n" % DEEP)),
    row("read-tracker-token-dev-zero", ["run", "--name", "x", *TRACKER, "/dev/zero", *CMD], 2, "character device"),
    row("read-tracker-token-fifo", ["run", "--name", "x", *TRACKER, "{tmp}/tok", *CMD], 2, "FIFO",
        files={"tok": FIFO}),
    row("read-tracker-token-too-large", ["run", "--name", "x", *TRACKER, "{tmp}/tok", *CMD], 2, "too large",
        files={"tok": "t" * (65 * 1024)}),
    row("read-mlflow-token-dev-zero", ["run", "--name", "x", *MLFLOW, "/dev/zero", *CMD], 2, "character device"),
    row("read-mlflow-token-link-dev-zero", ["run", "--name", "x", *MLFLOW, "{tmp}/tok", *CMD], 2,
        "character device", files={"tok": ZERO}),
    row("read-relaunch-config-deep", ["run", "--name", "r"], 2, "nests more than 64 levels",
        files={"home/runs/r/config.json": DEEP_JSON}),
    row("read-checkpoints-config-dev-zero", ["checkpoints", "r"], 2, "character device",
        files={"home/runs/r/config.json": ZERO}),
    row("read-status-state-deep", ["status", "r"], 2, "nests more than 64 levels", state=DEEP_JSON),
    row("read-status-state-fifo", ["status", "r"], 2, "FIFO", state=FIFO),
    row("read-stop-state-dev-zero", ["stop", "r"], 2, "character device", state=ZERO),
    row("read-node-group-fifo", ["run", "--name", "x", "--node-group", "{tmp}/g.json", *CMD], 2, "FIFO",
        files={"g.json": FIFO}),
    row("read-queue-journal-dev-zero", ["queue", "ls"], 2, "character device",
        files={"home/queue/journal.jsonl": ZERO}),
]


def committed(files: List[Dict[str, Any]], **fields: Any) -> Dict[str, Content]:
    """A committed checkpoint dir ck/ whose MANIFEST.json lists `files` (one real file, ok.txt, is there)."""
    doc = {"schema": "onbox.manifest/1", "name": "ck", "kind": "dir", "hash": "sha256", "files": files, **fields}
    return {"ck/ok.txt": "fine\n", "ck/MANIFEST.json": json.dumps(doc)}


with open("/etc/passwd", "rb") as _f:
    PASSWD = _f.read()
PASSWD_ENTRY = {"size": len(PASSWD), "sha256": hashlib.sha256(PASSWD).hexdigest()}
OK_ENTRY = {"path": "ok.txt", "size": 5, "sha256": hashlib.sha256(b"fine\n").hexdigest()}
ROWS += [  # issue 19: a manifest is untrusted input; verify vouches only for files inside the checkpoint
    row("verify-manifest-dotdot-passwd", ["verify", "{tmp}/ck"], 1, "files[0].path '../../../../../../../../../etc/passwd': a '..' part",
        files=committed([dict(PASSWD_ENTRY, path="../../../../../../../../../etc/passwd")])),
    row("verify-manifest-absolute-passwd", ["verify", "{tmp}/ck"], 1, "files[0].path '/etc/passwd': absolute path",
        files=committed([dict(PASSWD_ENTRY, path="/etc/passwd")])),
    row("verify-manifest-unknown-hash", ["verify", "{tmp}/ck"], 1, "unknown hash algorithm 'md7'",
        files=committed([OK_ENTRY], hash="md7")),
    row("verify-manifest-path-int", ["verify", "{tmp}/ck"], 1, "files[0].path 5: not a string",
        files=committed([dict(OK_ENTRY, path=5)])),
    row("verify-manifest-size-str", ["verify", "{tmp}/ck"], 1, "files[0].size '5' is not a byte count",
        files=committed([dict(OK_ENTRY, size="5")])),
    row("verify-manifest-files-str", ["verify", "{tmp}/ck"], 1, "no file list", files=committed("ok.txt")),
    row("verify-manifest-deep", ["verify", "{tmp}/ck"], 1, "nests more than",
        files={"ck/ok.txt": "fine\n", "ck/MANIFEST.json": "[" * 50_000 + "]" * 50_000}),
    row("verify-manifest-local-name-dotdot", ["verify", "{tmp}/ck"], 1, "local_name '../victim': a '..' part",
        files=committed([OK_ENTRY], local_name="../victim")),
    row("verify-proc-self", ["verify", "/proc/self"], 2, "kernel's /proc filesystem"),
    row("verify-dev-zero", ["verify", "/dev/zero"], 2, "kernel's /dev filesystem"),
]

ROWS += [  # issue 19: remaining readers
    row("read-relaunch-config-dev-zero", ["run", "--name", "r"], 2,
        "/runs/r/config.json: it is a character device, not a regular file", files={"home/runs/r/config.json": ZERO}),
    row("read-relaunch-config-fifo", ["run", "--name", "r"], 2, "config.json: it is a FIFO (named pipe), not a regular",
        files={"home/runs/r/config.json": FIFO}),
]

# A path whose own length is the problem (PATH_MAX 4096 with its NUL, NAME_MAX 255): relative, so that without the
# checks it would be accepted (made absolute under the row's tmp dir) rather than refused for another reason.
LONG_PATH = "/".join(["d" * 199] * 21) + "/" + "e" * 82  # 4,282 characters, every part under 255
ROWS += [  # issue 19: what run refuses before it starts
    row("run-env-contract-ckpt-dir", ["run", "--name", "x", "--ckpt-dir", "{tmp}/ck", "--env",
                                      "ONBOX_CKPT_DIR=/elsewhere", *CMD], 2, "--ckpt-dir"),
    row("run-env-contract-run", ["run", "--name", "x", "--env", "ONBOX_RUN=other", *CMD], 2, "--name"),
    row("run-env-contract-restart-count", ["run", "--name", "x", "--env", "ONBOX_RESTART_COUNT=0", *CMD], 2,
        "ONBOX_RESTART_COUNT"),
    row("run-env-contract-phase", ["run", "--name", "x", "--env", "ONBOX_PHASE_LR=0.1", *CMD], 2, "[[phase]]"),
    row("run-env-file-contract-resume", ["run", "--name", "x", "--env-file", "{tmp}/a.env", *CMD], 2,
        "ONBOX_RESUME_FROM", files={"a.env": "ONBOX_RESUME_FROM=/etc/passwd\n"}),
    row("run-secret-contract-metrics", ["run", "--name", "x", "--secret", "ONBOX_METRICS_FILE=m", *CMD], 2,
        "ONBOX_METRICS_FILE", files={"home/secrets/m": "/tmp/m.jsonl\n"}),
    row("run-file-env-contract-preempt", ["run", "--name", "x", "-f", F, *CMD], 2, "ONBOX_PREEMPT_FILE",
        files=run_file("[run]\nenv = {ONBOX_PREEMPT_FILE = '/tmp/p'}\n")),
    row("relaunch-config-env-contract", ["run", "--name", "r"], 2, "--ckpt-dir",
        run={"env": {"ONBOX_CKPT_DIR": "/elsewhere"}}),
    row("run-env-file-dev-zero", ["run", "--name", "x", "--env-file", "/dev/zero", *CMD], 2, "not a regular file"),
    row("run-env-file-fifo", ["run", "--name", "x", "--env-file", "{tmp}/job.env", *CMD], 2, "FIFO",
        files={"job.env": Fifo()}),
    row("run-secret-fifo", ["run", "--name", "x", "--secret", "HF_TOKEN", *CMD], 2, "FIFO",
        files={"home/secrets/HF_TOKEN": Fifo()}),
    row("run-ckpt-dir-root", ["run", "--name", "x", "--ckpt-dir", "/", *CMD], 2, "--ckpt-dir /"),
    row("run-ckpt-dir-tilde", ["run", "--name", "x", "--ckpt-dir", "~", *CMD], 2, "home directory",
        env={"HOME": "{tmp}/me"}, files={"me/.profile": ""}),
    row("run-ckpt-dir-tilde-slash", ["run", "--name", "x", "--ckpt-dir=~/", *CMD], 2, "home directory",
        env={"HOME": "{tmp}/me"}, files={"me/.profile": ""}),
    row("run-ckpt-dir-run-dir", ["run", "--name", "x", "--ckpt-dir", "{home}/runs/x", *CMD], 2, "ONBOX_HOME"),
    row("run-ckpt-dir-other-run", ["run", "--name", "x", "--ckpt-dir", "{home}/runs/y/checkpoints", *CMD], 2,
        "ONBOX_HOME"),
    row("run-ckpt-dir-holds-onbox-home", ["run", "--name", "x", "--ckpt-dir", "{tmp}", *CMD], 2, "ONBOX_HOME"),
    row("run-ckpt-dir-etc", ["run", "--name", "x", "--ckpt-dir", "/etc", *CMD], 2, "system directory"),
    row("run-ckpt-dir-usr-slash", ["run", "--name", "x", "--ckpt-dir", "/usr/", *CMD], 2, "system directory"),
    row("run-ckpt-dir-proc", ["run", "--name", "x", "--ckpt-dir", "/proc", *CMD], 2, "system directory"),
    row("run-ckpt-dir-var", ["run", "--name", "x", "--ckpt-dir", "/var", *CMD], 2, "system directory"),
    row("run-ckpt-dir-link-to-root", ["run", "--name", "x", "--ckpt-dir", "{tmp}/out", *CMD], 2, "--ckpt-dir",
        files={"out": Link("/")}),
    row("run-ckpt-dir-dotdot-to-root", ["run", "--name", "x", "--ckpt-dir", "{tmp}/../../../../../../..", *CMD], 2,
        "--ckpt-dir"),
    row("run-file-ckpt-dir-root", ["run", "--name", "x", "-f", F, *CMD], 2, "--ckpt-dir",
        files=run_file("[run]\nckpt_dir = '/'\n")),
    row("relaunch-config-ckpt-dir-root", ["run", "--name", "r"], 2, "--ckpt-dir", run={"ckpt_dir": "/"}),
    row("run-heartbeat-file-state-json", ["run", "--name", "x", "--heartbeat-file", "{home}/runs/x/state.json",
                                          *CMD], 2, "ONBOX_HOME"),
    row("run-heartbeat-file-other-run", ["run", "--name", "x", "--heartbeat-file", "{home}/runs/r/events.jsonl",
                                         *CMD], 2, "ONBOX_HOME", run={}),
    row("run-heartbeat-file-via-link", ["run", "--name", "x", "--heartbeat-file", "{tmp}/hb/x/state.json", *CMD],
        2, "ONBOX_HOME", files={"hb": Link("{home}/runs")}),
    row("run-heartbeat-file-secrets", ["run", "--name", "x", "--heartbeat-file", "{home}/secrets/HF_TOKEN", *CMD],
        2, "ONBOX_HOME", files={"home/secrets/HF_TOKEN": "v\n"}),
    row("run-ckpt-dir-long-part", ["run", "--name", "x", "--ckpt-dir", "{tmp}/" + "c" * 300, *CMD], 2, "255"),
    row("run-heartbeat-file-long-part", ["run", "--name", "x", "--heartbeat-file", "{tmp}/" + "h" * 256 + ".jsonl",
                                         *CMD], 2, "255"),
    row("run-ckpt-dir-too-long", ["run", "--name", "x", "--ckpt-dir", LONG_PATH, *CMD], 2, "4095"),
    row("run-durable-too-long", ["run", "--name", "x", "--durable", LONG_PATH, *CMD], 2, "4095"),
    row("run-durable-remote-too-long", ["run", "--name", "x", "--durable", "remote:" + LONG_PATH[7:], *CMD], 2,
        "4095"),
    row("run-durable-remote-long-part", ["run", "--name", "x", "--durable", "remote:b/" + "k" * 300, *CMD], 2, "255"),
    row("run-env-durable-too-long", ["run", "--name", "x", *CMD], 2, "--durable", env={"ONBOX_DURABLE": LONG_PATH}),
    row("run-file-durable-long-part", ["run", "--name", "x", "-f", F, *CMD], 2, "255",
        files=run_file("[run]\ndurable = '%s'\n" % ("~/" + "u" * 256))),
]

LEASE = "dur/x/leases/0000000001.gpu9-00000000-00000000.json"
LIVE_LEASE = json.dumps({"schema": "onbox.lease/1", "run": "x", "epoch": 1, "holder": "gpu9-00000000-00000000",
                         "host": "gpu9", "agent": {"pid": 1, "start_time": None}, "taken_at": 1.0,
                         "renewed_at": 4102444800.0, "ttl": 60.0, "base": [], "resumed_from": None,
                         "released_at": None})  # renewed "in 2100": live whenever this runs
DURABLE = ["run", "--name", "x", "--durable", "{tmp}/dur", *CMD]
ROWS += [  # issue 21: leases
    row("lease-corrupt", DURABLE, 2, "cannot be read: lease file", files={LEASE: "{not json"}),
    row("lease-deep", DURABLE, 2, "nests more than 64 levels", files={LEASE: DEEP_JSON}),
    row("lease-huge", DURABLE, 2, "too large", files={LEASE: " " * (5 << 20)}),
    row("lease-fifo", DURABLE, 2, "FIFO", files={LEASE: FIFO}),
    row("lease-dev-zero", DURABLE, 2, "character device", files={LEASE: ZERO}),
    row("lease-other-run", DURABLE, 2, "a lease of run 'y'", files={LEASE: LIVE_LEASE.replace('"x"', '"y"')}),
    row("lease-held-by-another", DURABLE, 2, "held by another agent: gpu9-00000000-00000000 on gpu9",
        files={LEASE: LIVE_LEASE}),
    row("lease-take-over-no-durable", ["run", "--name", "x", "--take-over", *CMD], 2, "--take-over"),
]

DEADLINE = ["run", "--name", "x", "--deadline"]
IN_SLURM = {"SLURM_JOB_ID": "4242", "PATH": "{tmp}/bin:" + os.environ.get("PATH", "/usr/bin:/bin")}
ROWS += [  # issue 24: deadlines
    row("deadline-past", [*DEADLINE, "2020-01-01T00:00:00Z", *CMD], 2, "is in the past"),
    row("deadline-shorter-than-grace-and-commit", [*DEADLINE, "45s", *CMD], 2, "shorter than the stop needs"),
    row("deadline-short-for-its-grace", [*DEADLINE, "2m", "--grace", "90", *CMD], 2, "grace 90 s"),
    row("deadline-unparsable", [*DEADLINE, "tomorrow", *CMD], 2, "not a time or a duration"),
    row("deadline-no-zone", [*DEADLINE, "2030-01-01T00:00", *CMD], 2, "has no zone"),
    row("deadline-bad-date", [*DEADLINE, "2030-02-30T00:00Z", *CMD], 2, "day is out of range"),
    row("deadline-env-unparsable", ["run", "--name", "x", *CMD], 2, "not a time", env={"ONBOX_DEADLINE": "soon"}),
    row("deadline-margin-nan", ["run", "--name", "x", *CMD], 2, "deadline_margin",
        env={"ONBOX_DEADLINE_MARGIN": "nan"}),
    row("deadline-slurm-outside-a-job", [*DEADLINE, "slurm", *CMD], 2, "not inside a Slurm job"),
    # scontrol answers nothing usable (here: it fails): the job's end time cannot be read
    row("deadline-slurm-end-unreadable", [*DEADLINE, "slurm", *CMD], 3, "end time of slurm job 4242 cannot be read",
        env=IN_SLURM, files={"bin/scontrol": Link("/bin/false")}),
    # a relaunch resolves its own deadline: an absolute one recorded earlier that has passed is refused
    row("deadline-relaunch-record-past", ["run", "--name", "r"], 2, "is in the past",
        run={"deadline": "2020-01-01T00:00:00Z", "workdir": "/"}),
]


def _fill(value: str, tmp: str, home: str) -> str:
    return value.replace("{tmp}", tmp).replace("{home}", home)


def _snapshot(root: str) -> Dict[str, Any]:
    """Every entry under root: its kind, mode and (files) a digest of the content."""
    out: Dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
                if os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as f:
                        out[os.path.relpath(path, root)] = ("f", st.st_mode, hashlib.sha256(f.read()).hexdigest())
                else:
                    out[os.path.relpath(path, root)] = ("d", st.st_mode)
            except FileNotFoundError:  # a temp file of an agent that should not exist: the diff shows the rest
                continue
    return out


def agent_tracebacks(root: str) -> List[str]:
    """agent.log files under root that hold a traceback (a detached agent's crash never reaches stderr)."""
    found = []
    for dirpath, _dirs, filenames in os.walk(root):
        if "agent.log" in filenames:
            with open(os.path.join(dirpath, "agent.log"), errors="replace") as f:
                text = f.read()
            if "Traceback" in text:
                found.append(text[-1500:])
    return found


def message_line(stderr: str) -> str:
    """The error line: the first `onbox: ...` (warnings aside) or click's `Error: ...`."""
    for line in stderr.splitlines():
        if line.startswith("onbox: warning:"):
            continue
        if line.startswith(("onbox: ", "Error: ")):
            return line
    return ""


@pytest.mark.parametrize("case", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_refused_cleanly(case: Row, tmp_path):
    tmp = str(tmp_path)
    home = os.path.join(tmp, "home")
    os.makedirs(home, exist_ok=True)
    for rel, content in case.files.items():
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(content, Fifo):
            os.mkfifo(path)
            continue
        if isinstance(content, Link):
            os.symlink(_fill(content.target, tmp, home), path)
            continue
        with open(path, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode("utf-8"))  # type: ignore[union-attr]
    env = subprocess_env({"ONBOX_HOME": home, **FAST})
    env.update({k: _fill(v, tmp, home) for k, v in case.env.items()})
    argv = [_fill(a, tmp, home) for a in case.argv]
    before = _snapshot(tmp)
    try:
        r = subprocess.run([PY, "-m", "onbox", *argv], env=env, input=case.stdin, capture_output=True, text=True,
                           timeout=60, cwd=tmp)
        after = _snapshot(tmp)
        left = pids_with_home(env["ONBOX_HOME"])
        crashed = agent_tracebacks(tmp)
    finally:
        kill_test_processes(env["ONBOX_HOME"], settle=0.0)
    out = r.stdout + r.stderr
    # The order of the checks is the order of their weight (the sweep counts report the first that fails).
    assert "Traceback" not in out, "TRACEBACK: %s" % out[-3000:]
    assert not crashed, "TRACEBACK in agent.log: %s" % crashed
    assert r.returncode == case.code, "EXIT %d, expected %d: %s" % (r.returncode, case.code, out[-2000:])
    line = message_line(r.stderr)
    assert case.msg.lower() in line.lower(), "MESSAGE: %r lacks %r; stderr: %s" % (line, case.msg, r.stderr)
    assert not left, "LEFTOVER processes %s" % left
    assert after == before, "HALF-WRITTEN: %s" % sorted(set(after.items()) ^ set(before.items()))
