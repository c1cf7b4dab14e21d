"""The `onboxctl` half of the bad-input sweep: every row is fed to the real CLI in a subprocess.

Each row: argv, stdin, files placed first (config dir, inventory, token, certificates ...), extra environment,
the exit code (2 bad input, 3 environment unfit) and a piece of the one message. For every row: that code; that
piece in the one `onboxctl: ...` (or click's `Error: ...`) line; no traceback; nothing written or half-written
(the row's whole directory is byte-identical before and after; a row that reached for the network would have
made the ssh control directory there, or failed on the closed port 9 its box points at).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional

import pytest

from tests.conftest import subprocess_env

pytestmark = pytest.mark.integration

BOX = '[boxes.b]\nhost = "127.0.0.1"\nport = 9\n'  # closed port: a row that reached ssh would fail with exit 3
BOXES = {"cfg/boxes.toml": BOX}
PY = sys.executable


class Row(NamedTuple):
    id: str
    argv: List[str]
    code: int
    says: str
    stdin: bytes = b""
    files: Dict[str, object] = {}
    env: Dict[str, str] = {}
    wrap: Optional[List[str]] = None  # a command prefix (a private mount namespace)


def R(id, argv, code, says, stdin=b"", files=None, env=None, wrap=None):
    return Row(id, argv.split() if isinstance(argv, str) else argv, code, says, stdin, dict(files or {}),
               dict(env or {}), wrap)


def fifo(path):
    os.mkfifo(path, 0o600)


def dev_zero(path):
    os.symlink("/dev/zero", path)


DEEP_TOML = '[boxes.b]\nhost = "h"\noptions = %s%s\n' % ("[" * 50000, "]" * 50000)
DEEP_JSON = '{"boxes": %s%s}' % ("[" * 100000, "]" * 100000)
TUNNEL = '{"tunnels": [{"box": "b", "local": "127.0.0.1:%s", "remote_port": 40000, "spec_port": 40000}]}'
TRACKER9 = "--tracker http://127.0.0.1:9 --tracker-token-file"
TUNNEL_WITH = '{"tunnels": [{"box": "b", "local": "127.0.0.1:9", "remote_port": 40000, "spec_port": 40000, %s}]}'


def RUNPOD_BOX(profile):
    """A box on the runpod profile, with the user's own runpod.toml (in ONBOX_HOME) as given."""
    return {"cfg/boxes.toml": BOX + 'profile = "runpod"\n', "onbox/profiles/runpod.toml": profile}
CFG_FILE = {"files": {"fan": "x"}, "env": {"ONBOX_CONFIG_DIR": "TMP/fan"}}  # the config dir is a file


def other_sqlite(path):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE beats (x INTEGER)")
    con.commit()
    con.close()


ROWS = [
    # -- box add: what ssh would read as an option, and malformed values
    R("host-option", ["box", "add", "x", "--host", "-oProxyCommand=touch pwned"], 2, "must not start with '-'"),
    R("host-F", ["box", "add", "x", "--host", "-F/tmp/evil"], 2, "must not start with '-'"),
    R("host-space", ["box", "add", "x", "--host", "a b"], 2, "no spaces"),
    R("host-empty", ["box", "add", "x", "--host", ""], 2, "must not be empty"),
    R("host-newline", ["box", "add", "x", "--host", "a\nb"], 2, "no spaces or control characters"),
    R("user-option", ["box", "add", "x", "--host", "h", "--user", "-oProxyCommand=x"], 2, "invalid user"),
    R("alias-option", ["box", "add", "--host", "h", "--", "-oProxyCommand=x"], 2, "invalid box name"),
    R("name-bang", ["box", "add", "bad!", "--host", "h"], 2, "invalid box name"),
    R("name-newline", ["box", "add", "x\n", "--host", "h"], 2, "invalid box name"),
    R("port-zero", "box add x --host h --port 0", 2, "Invalid value for '--port'"),
    R("port-big", "box add x --host h --port 70000", 2, "Invalid value for '--port'"),
    R("port-word", "box add x --host h --port ssh", 2, "Invalid value for '--port'"),
    R("ssh-option-noeq", "box add x --host h --ssh-option StrictHostKeyChecking", 2, "Key=Value"),
    R("ssh-option-newline", ["box", "add", "x", "--host", "h", "--ssh-option", "A=b\nProxyCommand=x"], 2, "Key=Value"),
    R("profile-unknown", "box add x --host h --profile nosuch", 2, "unknown profile"),
    R("identity-missing", "box add x --host h --identity /nonexistent/key", 2, "identity file /nonexistent/key"),
    R("python-empty", ["box", "add", "x", "--host", "h", "--python", ""], 2, "invalid python"),
    R("python-option", ["box", "add", "x", "--host", "h", "--python", "-c"], 2, "invalid python"),
    R("host-missing", "box add x", 2, "Missing option '--host'"),
    R("box-exists", "box add b --host h", 2, "already in the inventory", files=BOXES),
    R("rm-unknown", "box rm nosuch", 2, "not in the inventory", files=BOXES),
    # -- a hand-edited inventory
    R("inv-toml", "box ls", 2, "is not valid TOML", files={"cfg/boxes.toml": "[boxes.b\nhost = 1"}),
    R("inv-host-option", "box ls", 2, "must not start with '-'",
      files={"cfg/boxes.toml": '[boxes.b]\nhost = "-oProxyCommand=touch x"\n'}),
    R("inv-user-option", "box ls", 2, "invalid user", files={"cfg/boxes.toml": BOX + 'user = "-lroot"\n'}),
    R("inv-port-str", "box ls", 2, "port must be 1-65535", files={"cfg/boxes.toml": '[boxes.b]\nhost="h"\nport="22"\n'}),
    R("inv-port-bool", "box ls", 2, "port must be 1-65535", files={"cfg/boxes.toml": '[boxes.b]\nhost="h"\nport=true\n'}),
    R("inv-no-host", "box ls", 2, "needs a host", files={"cfg/boxes.toml": '[boxes.b]\nport = 22\n'}),
    R("inv-unknown-key", "box ls", 2, "unknown key(s) hots", files={"cfg/boxes.toml": BOX + 'hots = "h"\n'}),
    R("inv-boxes-int", "box ls", 2, "[boxes] must be a table", files={"cfg/boxes.toml": "boxes = 5\n"}),
    R("inv-options-str", "box ls", 2, "options must be a list",
      files={"cfg/boxes.toml": BOX + 'options = "StrictHostKeyChecking=no"\n'}),
    R("inv-name", "box ls", 2, "invalid box name", files={"cfg/boxes.toml": '[boxes."a b"]\nhost = "h"\n'}),
    R("inv-user-int", "box ls", 2, "user must be a string", files={"cfg/boxes.toml": BOX + "user = 5\n"}),
    R("inv-json", "box ls", 2, "is not valid JSON", files={"cfg/boxes.json": "{not json"}),
    R("inv-latin1", "box ls", 2, "is not UTF-8", files={"cfg/boxes.toml": b'[boxes.b]\nhost = "h\xe9"\n'}),
    # -- config.toml
    R("cfg-tracker-int", "status", 2, "tracker must be a non-empty string", files={"cfg/config.toml": "tracker = 5\n"}),
    R("cfg-tracker-url", "status", 2, "not an http(s) URL", files={"cfg/config.toml": 'tracker = "notaurl"\n'}),
    R("cfg-unknown", "status", 2, "unknown key 'trackr'", files={"cfg/config.toml": 'trackr = "http://h"\n'}),
    R("cfg-token-int", "status", 2, "tracker_token_file must be a non-empty string",
      files={"cfg/config.toml": 'tracker = "http://127.0.0.1:9"\ntracker_token_file = 7\n'}),
    R("cfg-toml", "status", 2, "is not valid TOML", files={"cfg/config.toml": "tracker = \n"}),
    R("cfg-token-missing", "status", 2, "cannot read tracker token file",
      files={"cfg/config.toml": 'tracker = "http://127.0.0.1:9"\ntracker_token_file = "/nonexistent"\n'}),
    # -- status
    R("status-notaurl", "status --tracker notaurl", 2, "not an http(s) URL"),
    R("status-ftp", "status --tracker ftp://h/x", 2, "not an http(s) URL"),
    R("status-nohost", "status --tracker http://", 2, "no host in it"),
    R("status-port", "status --tracker http://h:99999", 2, "out of range"),
    R("status-creds", "status --tracker http://me:pw@h:8787", 2, "credentials in the URL"),
    R("status-space", ["status", "--tracker", "http://h :8787"], 2, "tracker URL"),
    R("status-interval-zero", "status --interval 0", 2, "Invalid value for '--interval'"),
    R("status-interval-nan", "status --interval nan", 2, "Invalid value for '--interval'"),
    R("status-count-zero", "status --count 0", 2, "Invalid value for '--count'"),
    R("status-env-url", "status", 2, "ONBOX_TRACKER", env={"ONBOX_TRACKER": "127.0.0.1:8787"}),
    R("status-token-empty", "status --tracker http://127.0.0.1:9 --tracker-token-file TMP/tok", 2, "is empty",
      files={"tok": ""}),
    R("status-token-ctrl", "status --tracker http://127.0.0.1:9 --tracker-token-file TMP/tok", 2,
      "holds control characters", files={"tok": "abc\x07def\n"}),
    R("status-down", "status --tracker http://127.0.0.1:9", 3, "cannot read the tracker"),
    # -- run: everything refused before any connection
    R("run-no-box", "run -- python train.py", 2, "no box given"),
    R("run-no-cmd", "run b", 2, "no command to run on b", files=BOXES),
    R("run-name", "run b --name ../x -- true", 2, "invalid run name", files=BOXES),
    R("run-name-newline", ["run", "b", "--name", "x\n", "--", "true"], 2, "invalid run name", files=BOXES),
    R("run-env", "run b --env NOEQUALS -- true", 2, "--env must look like KEY=VAL", files=BOXES),
    R("run-env-key", "run b --env =v -- true", 2, "--env must look like KEY=VAL", files=BOXES),
    R("run-set", ["run", "b", "--set", "a b=1", "--", "true"], 2, "--set must look like FIELD=VALUE", files=BOXES),
    R("run-tracker", "run b --tracker notaurl -- true", 2, "not an http(s) URL", files=BOXES),
    R("run-nodes-one-box", "run b --nodes --durable /d -- true", 2, "two boxes or more", files=BOXES),
    R("run-nodes-no-durable", "run b c --nodes -- torchrun t.py", 2, "--nodes needs --durable", files=BOXES),
    R("run-nodes-nothing", "run b c --nodes", 2, "no command to run", files=BOXES),
    R("run-nodes-fanout", "run b c --nodes --fanout TMP/f --durable /d -- true", 2, "not from --fanout",
      files=dict(BOXES, f="b\n")),
    R("run-master-addr-alone", "run b --master-addr 10.0.0.1 -- true", 2, "goes with --nodes", files=BOXES),
    R("run-grace-nan", "run b --grace nan -- true", 2, "not a number of seconds", files=BOXES),
    R("run-grace-neg", "run b --grace -1 -- true", 2, "not a number of seconds", files=BOXES),
    R("run-grace-huge", "run b --grace 1e308 -- true", 2, "not a number of seconds", files=BOXES),
    R("run-hb-inf", "run b --heartbeat-interval inf -- true", 2, "not a number of seconds", files=BOXES),
    R("run-sync-zero", "run b --sync-interval 0 -- true", 2, "not a number of seconds", files=BOXES),
    R("run-timeout-word", "run b --timeout soon -- true", 2, "is not a number of seconds", files=BOXES),
    R("run-restarts-neg", "run b --max-restarts -1 -- true", 2, "Invalid value for '--max-restarts'", files=BOXES),
    R("run-restart", "run b --restart sometimes -- true", 2, "Invalid value for '--restart'", files=BOXES),
    R("run-parallel", "run b --parallel 0 -- true", 2, "Invalid value for '--parallel'", files=BOXES),
    R("run-tunnel-alone", "run b --tunnel -- true", 2, "--tunnel needs --tracker", files=BOXES),
    R("run-workdir", "run b --workdir -x -- true", 2, "invalid --workdir", files=BOXES),
    R("run-secret-path", "run b --secret ../tok -- true", 2, "is not a secret name", files=BOXES),
    R("run-secret-var", "run b --secret 1X=tok -- true", 2, "--secret", files=BOXES),
    R("run-env-file-option", "run b --env-file -x -- true", 2, "invalid --env-file", files=BOXES),
    R("run-mlflow-url", "run b --mlflow notaurl -- true", 2, "--mlflow 'notaurl'", files=BOXES),
    R("run-mlflow-creds", "run b --mlflow http://u:p@mlflow:5000 -- true", 2, "credentials in the URL", files=BOXES),
    R("run-mlflow-exp-alone", "run b --mlflow-experiment x -- true", 2, "goes with --mlflow", files=BOXES),
    R("run-mlflow-token-option", "run b --mlflow http://m:5000 --mlflow-token-file -x -- true", 2,
      "invalid --mlflow-token-file", files=BOXES),
    R("run-fanout-missing", "run --fanout /nonexistent/fan", 2, "cannot read fan-out file"),
    R("run-fanout-shape", "run --fanout TMP/fan", 2, "expected `BOX` or `BOX -- CMD ...`",
      files={"fan": "b python x.py\n", **BOXES}),
    R("run-fanout-quote", "run --fanout TMP/fan", 2, "No closing quotation", files={"fan": "b -- echo 'x\n", **BOXES}),
    R("run-fanout-option-box", "run --fanout TMP/fan", 2, "invalid box name", files={"fan": "-oProxyCommand=x -- true\n"}),
    # -- run without --name: which run it continues (--new, --name, the launch log a replacement box reads)
    R("run-new-name", "run b --new --name x -- true", 2, "--new and --name together", files=BOXES),
    R("run-new-nodes", "run b b --nodes --new --durable /d -- true", 2, "--new goes with single-box", files=BOXES),
    R("run-launches-json", "run b -- true", 2, "launch log", files={"cfg/launches.json": "{broken", **BOXES}),
    R("run-launches-shape", "run b -- true", 2, 'not {"launches": [...]}',
      files={"cfg/launches.json": '{"launches": {}}', **BOXES}),
    R("run-launches-entry", "run b -- true", 2, "entry 1: run '../x' is not a run name",
      files={"cfg/launches.json": '{"launches": [{"run": "../x", "box": "b", "command": ["true"], "at": 1}]}',
             **BOXES}),
    R("run-launches-fifo", "run b -- true", 2, "FIFO", files={"cfg/launches.json": fifo, **BOXES}),
    R("run-launches-dev-zero", "run b -- true", 2, "character device", files={"cfg/launches.json": dev_zero, **BOXES}),
    R("run-launches-deep", "run b -- true", 2, "nests more than 64 levels",
      files={"cfg/launches.json": '{"launches": %s%s}' % ("[" * 100000, "]" * 100000), **BOXES}),
    # -- secrets: an empty value is refused before any connection
    R("secret-devnull", "secrets push b tok", 2, "empty secret on stdin", files=BOXES),
    R("secret-blank", "secrets push b tok", 2, "empty secret on stdin", stdin=b"\n  \n", files=BOXES),
    R("secret-name", "secrets push b ../tok", 2, "invalid secret name", stdin=b"v", files=BOXES),
    R("secret-box-option", "secrets push -- -oProxyCommand=x tok", 2, "invalid box name", stdin=b"v"),
    # -- pull, logs, down
    R("pull-attempts", "pull b r --attempts 0", 2, "Invalid value for '--attempts'", files=BOXES),
    R("pull-run-traversal", "pull b ../../etc TMP/dest", 2, "invalid run name", files=BOXES),
    R("pull-box-option", "pull -- -oProxyCommand=x r", 2, "invalid box name"),
    R("pull-dest-file", "pull b r TMP/fan", 2, "is a file", files={"fan": "x", **BOXES}),
    R("logs-lines", "logs b r -n 0", 2, "Invalid value for '-n'", files=BOXES),
    R("logs-run-option", "logs b -- -r", 2, "invalid run name", files=BOXES),
    R("down-abandon", "down b --abandon ../x", 2, "invalid run name", files=BOXES),
    # -- stop: checked before any connection (the box's own answers: tests/integration/test_controller_stop.py)
    R("stop-grace-nan", "stop b r --grace nan", 2, "not a number of seconds", files=BOXES),
    R("stop-grace-neg", "stop b r --grace -1", 2, "not a number of seconds", files=BOXES),
    R("stop-grace-huge", "stop b r --grace 86401", 2, "not a number of seconds", files=BOXES),
    R("stop-grace-inf", "stop b r --grace inf", 2, "not a number of seconds", files=BOXES),
    R("stop-grace-word", "stop b r --grace soon", 2, "not a number of seconds", files=BOXES),
    R("stop-run-missing", "stop b", 2, "Missing argument 'RUN'", files=BOXES),
    R("stop-box-missing", "stop", 2, "Missing argument 'BOX'"),
    R("stop-run-traversal", "stop b ../x", 2, "invalid run name", files=BOXES),
    R("stop-run-option", "stop b -- -r", 2, "invalid run name", files=BOXES),
    R("stop-box-option", "stop -- -oProxyCommand=x r", 2, "invalid box name"),
    R("stop-wait-value", "stop b r --wait 5", 2, "Got unexpected extra argument (5)", files=BOXES),
    R("down-box-option", "down -- -oProxyCommand=x", 2, "invalid box name"),
    # -- tracker serve: paths, tokens, ports, TLS, limits
    R("db-under-file", "tracker serve --port 0 --db TMP/fan/t.db", 2, "is a file, not a directory", files={"fan": "x"}),
    R("db-proc", "tracker serve --port 0 --db /proc/onbox-t.db", 2, "cannot create the tracker database"),
    R("db-sys", "tracker serve --port 0 --db /sys/onbox-t.db", 3, "Permission denied"),
    R("db-dir", "tracker serve --port 0 --db TMP", 2, "is a directory"),
    R("db-garbage", "tracker serve --port 0 --db TMP/fan", 2, "not a tracker database", files={"fan": "x" * 200}),
    R("db-other-app", "tracker serve --port 0 --db TMP/other.db", 2, "not a database of this tracker",
      files={"other.db": other_sqlite}),
    R("db-readonly-fs", "tracker serve --port 0 --db TMP/ro/t.db", 3, "Read-only file system",
      files={"ro/.keep": ""}, wrap=["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                    'mount -t tmpfs -o ro onbox-ro "$0/ro" && shift && exec "$@"', "TMP", "--"]),
    R("token-missing", "tracker serve --port 0 --db TMP/t.db --token-file /nonexistent/tok", 2,
      "cannot read the token file"),
    R("token-empty", "tracker serve --port 0 --db TMP/t.db --token-file TMP/tok", 2, "is empty", files={"tok": "\n"}),
    R("token-ctrl", "tracker serve --port 0 --db TMP/t.db --token-file TMP/tok", 2, "control characters",
      files={"tok": "a\x1bb\n"}),
    R("serve-port", "tracker serve --port 70000 --db TMP/t.db", 2, "Invalid value for '--port'"),
    R("serve-host", ["tracker", "serve", "--port", "0", "--db", "TMP/t.db", "--host", "no such host"], 2,
      "cannot listen on no such host"),
    R("serve-max-body", "tracker serve --port 0 --db TMP/t.db --max-body 10", 2, "Invalid value for '--max-body'"),
    R("serve-header-nan", "tracker serve --port 0 --db TMP/t.db --header-timeout nan", 2, "not a number of seconds"),
    R("serve-body-zero", "tracker serve --port 0 --db TMP/t.db --body-timeout 0", 2, "not a number of seconds"),
    R("serve-conns-zero", "tracker serve --port 0 --db TMP/t.db --max-conns 0", 2, "Invalid value for '--max-conns'"),
    R("tls-cert-only", "tracker serve --port 0 --db TMP/t.db --tls-cert TMP/fan", 2, "go together", files={"fan": "x"}),
    R("tls-garbage", "tracker serve --port 0 --db TMP/t.db --tls-cert TMP/fan --tls-key TMP/fan", 2,
      "not a PEM certificate", files={"fan": "x"}),
    R("tls-missing", "tracker serve --port 0 --db TMP/t.db --tls-cert /nonexistent/c --tls-key /nonexistent/k", 2,
      "cannot read"),
    # -- tunnel
    R("tunnel-unknown", "tunnel nosuch", 2, "no tunnel recorded for nosuch"),
    R("tunnel-both", "tunnel --close --keep", 2, "contradict"),
    R("tunnel-record", "tunnel", 2, "tunnel record", files={"cfg/tunnels.json": "{broken"}),
    R("tunnel-interval", "tunnel --keep --interval 0", 2, "not a number of seconds"),
    # issue 22: the tunnel's supervisor (its record fields, its knobs) and onbox's known_hosts
    R("tunnel-record-supervisor", "tunnel", 2, "supervisor_pid -5 is not a process id",
      files={"cfg/tunnels.json": TUNNEL_WITH % '"supervisor_pid": -5', **BOXES}),
    R("tunnel-record-state", "tunnel", 2, "state 'sideways' is not up or down",
      files={"cfg/tunnels.json": TUNNEL_WITH % '"state": "sideways"', **BOXES}),
    R("tunnel-record-since", "tunnel", 2, "since -1 is not a number of 0 or more",
      files={"cfg/tunnels.json": TUNNEL_WITH % '"since": -1', **BOXES}),
    R("tunnel-record-reopens", "tunnel", 2, "reopens 'many' is not a number",
      files={"cfg/tunnels.json": TUNNEL_WITH % '"reopens": "many"', **BOXES}),
    R("tunnel-record-error", "tunnel", 2, "last_error 5 is not a string",
      files={"cfg/tunnels.json": TUNNEL_WITH % '"last_error": 5', **BOXES}),
    R("tunnel-watch-env", "tunnel", 2, "ONBOX_TUNNEL_WATCH=maybe", env={"ONBOX_TUNNEL_WATCH": "maybe"}),
    R("tunnel-poll-nan", "tunnel", 2, "ONBOX_TUNNEL_POLL=nan: not a number of seconds",
      env={"ONBOX_TUNNEL_POLL": "nan"}),
    R("tunnel-give-up-word", "tunnel", 2, "ONBOX_TUNNEL_GIVE_UP=forever", env={"ONBOX_TUNNEL_GIVE_UP": "forever"}),
    R("run-tunnel-backoff", "run b --tracker http://127.0.0.1:9 -- true", 2, "ONBOX_TUNNEL_BACKOFF_MAX=0",
      env={"ONBOX_TUNNEL_BACKOFF_MAX": "0"}, files=BOXES),
    R("run-tunnel-check-inf", "run b --tracker http://127.0.0.1:9 -- true", 2, "ONBOX_TUNNEL_RUN_CHECK=inf",
      env={"ONBOX_TUNNEL_RUN_CHECK": "inf"}, files=BOXES),
    R("forget-key-unknown", "box forget-key nosuch", 2, "box 'nosuch' is not in the inventory", files=BOXES),
    R("forget-key-name", ["box", "forget-key", "bad!"], 2, "invalid box name"),
    R("forget-key-option", "box forget-key -- -oProxyCommand=x", 2, "invalid box name"),
    R("forget-key-missing", "box forget-key", 2, "Missing argument"),
    R("forget-key-own-file", "box forget-key b", 2, "keeps its host keys where its own ssh options say",
      files={"cfg/boxes.toml": BOX + 'options = ["UserKnownHostsFile=/x/kh"]\n'}),
    R("forget-key-own-strict", "box forget-key b", 2, "StrictHostKeyChecking=no",
      files={"cfg/boxes.toml": BOX + 'options = ["StrictHostKeyChecking=no"]\n'}),
    R("forget-key-fifo", "box forget-key b", 2, "is not a regular file", files={"cfg/known_hosts": fifo, **BOXES}),
    R("forget-key-dev-zero", "box forget-key b", 2, "is a symlink", files={"cfg/known_hosts": dev_zero, **BOXES}),
    R("forget-key-dir", "box forget-key b", 2, "is a directory", files={"cfg/known_hosts/x": "", **BOXES}),
    R("forget-key-inv-broken", "box forget-key b", 2, "is not valid TOML", files={"cfg/boxes.toml": "[boxes.b\n"}),
    # -- issue 19: unbounded and hostile reads, the config dir, one inventory
    R("read-inv-dev-zero", "box ls", 2, "character device", files={"cfg/boxes.toml": dev_zero}),
    R("read-inv-fifo", "box ls", 2, "FIFO", files={"cfg/boxes.toml": fifo}),
    R("read-inv-too-large", "box ls", 2, "too large", files={"cfg/boxes.toml": "#" * (5 << 20)}),
    R("read-inv-deep", "box ls", 2, "nests too deeply", files={"cfg/boxes.toml": DEEP_TOML}),
    R("read-inv-deep-run", "run b -- true", 2, "nests too deeply", files={"cfg/boxes.toml": DEEP_TOML}),
    R("read-inv-json-dev-zero", "box ls", 2, "character device", files={"cfg/boxes.json": dev_zero}),
    R("read-inv-json-deep", "box ls", 2, "nests more than 64 levels", files={"cfg/boxes.json": DEEP_JSON}),
    R("read-inv-json-list", "box ls", 2, "not a JSON object", files={"cfg/boxes.json": "[]"}),
    R("read-inv-both-ls", "box ls", 2, "both", files={"cfg/boxes.toml": BOX, "cfg/boxes.json": '{"boxes": {}}'}),
    R("read-inv-both-add", "box add c --host h", 2, "boxes.json",
      files={"cfg/boxes.toml": BOX, "cfg/boxes.json": '{"boxes": {}}'}),
    R("read-tunnel-deep", "tunnel", 2, "nests more than 64 levels",
      files={"cfg/tunnels.json": '{"tunnels": %s%s}' % ("[" * 100000, "]" * 100000)}),
    R("read-tunnel-port-word", "tunnel", 2, "is not host:port", files={"cfg/tunnels.json": TUNNEL % "abc", **BOXES}),
    R("read-tunnel-port-big", "tunnel b", 2, "is not host:port", files={"cfg/tunnels.json": TUNNEL % "99999"}),
    R("read-tunnel-dev-zero", "tunnel", 2, "character device", files={"cfg/tunnels.json": dev_zero}),
    R("read-cfgdir-file-box-add", "box add b --host h", 2, "is not a directory", **CFG_FILE),
    R("read-cfgdir-file-box-ls", "box ls", 2, "is not a directory", **CFG_FILE),
    R("read-cfgdir-file-box-rm", "box rm b", 2, "is not a directory", **CFG_FILE),
    R("read-cfgdir-file-tunnel", "tunnel", 2, "is not a directory", **CFG_FILE),
    R("read-cfgdir-file-status", "status", 2, "is not a directory", **CFG_FILE),
    R("read-cfgdir-under-file", "box ls", 2, "is under", files={"fan": "x"}, env={"ONBOX_CONFIG_DIR": "TMP/fan/cfg"}),
    R("read-cfg-dev-zero", "status", 2, "character device", files={"cfg/config.toml": dev_zero}),
    R("read-cfg-token-dev-zero", "status", 2, "character device",
      files={"cfg/config.toml": 'tracker = "http://127.0.0.1:9"\ntracker_token_file = "/dev/zero"\n'}),
    R("read-status-token-dev-zero", "status %s /dev/zero" % TRACKER9, 2, "character device"),
    R("read-status-token-fifo", "status %s TMP/tok" % TRACKER9, 2, "FIFO", files={"tok": fifo}),
    R("read-serve-token-dev-zero", "tracker serve --port 0 --db TMP/t.db --token-file /dev/zero", 2,
      "character device"),
    R("read-serve-token-fifo", "tracker serve --port 0 --db TMP/t.db --token-file TMP/tok", 2, "FIFO",
      files={"tok": fifo}),
    R("read-serve-token-too-large", "tracker serve --port 0 --db TMP/t.db --token-file TMP/tok", 2, "too large",
      files={"tok": "t" * (65 * 1024)}),
    R("read-serve-cfgdir-file", "tracker serve --port 0 --db TMP/t.db", 2, "is not a directory", **CFG_FILE),
    # -- the command line itself
    R("unknown-command", "frobnicate", 2, "No such command 'frobnicate'"),
    R("unknown-option", "status --bogus", 2, "No such option: --bogus"),
]

ROWS += [  # issue 19: remaining readers
    R("read-fanout-fifo", "run --fanout TMP/fan", 2, "FIFO", files={"fan": fifo, **BOXES}),
    R("read-fanout-dev-zero", "run --fanout /dev/zero", 2, "character device", files=BOXES),
    R("read-fanout-too-large", "run --fanout TMP/fan", 2, "too large", files={"fan": "#\n" * (3 << 20), **BOXES}),
    R("read-fanout-latin1", "run --fanout TMP/fan", 2, "can't decode byte 0xe9", files={"fan": b"b\xe9\n", **BOXES}),
    R("read-down-profile-fifo", "down b", 2, "onbox/profiles/runpod.toml is a FIFO", files=RUNPOD_BOX(fifo)),
    R("read-down-profile-dev-zero", "down b", 2, "character device", files=RUNPOD_BOX(dev_zero)),
    R("read-down-profile-toml", "down b", 2, "is not valid TOML", files=RUNPOD_BOX("[billing\n")),
]

# issue 24: onboxctl kaggle refuses before the kaggle CLI is run (and a row that ran it would meet a closed port)
NO_KAGGLE = {"KAGGLE_API_ENVIRONMENT": "LOCALHOST", "http_proxy": "http://127.0.0.1:9", "KAGGLE_USERNAME": "",
             "KAGGLE_KEY": "", "KAGGLE_CONFIG_DIR": "TMP/kc"}
CREDS = dict(NO_KAGGLE, KAGGLE_USERNAME="tester", KAGGLE_KEY="k")
PUSH = "kaggle push TMP/k --name r %s-- python3 t.py"
ROWS += [
    R("kaggle-run-name", PUSH % "--name ../x ", 2, "invalid run name", env=CREDS),
    R("kaggle-durable-path", PUSH % "--durable /mnt/ckpt ", 2, "is no rclone remote", env=CREDS),
    R("kaggle-no-credentials", PUSH % "", 3, "no Kaggle credentials", env=NO_KAGGLE),
    R("kaggle-json-garbage", PUSH % "", 2, "cannot be read", files={"kc/kaggle.json": "{x"}, env=NO_KAGGLE),
    R("kaggle-json-no-key", PUSH % "", 2, "has no username and key", files={"kc/kaggle.json": '{"username": "u"}'},
      env=NO_KAGGLE),
    R("kaggle-folder-not-ours", PUSH % "", 2, "not a kernel folder's", files={"k/train.py": "mine"}, env=CREDS),
    R("kaggle-no-pyz", PUSH % "--pyz TMP/none.pyz ", 2, "no onbox.pyz", env=CREDS),
    R("kaggle-code-missing", PUSH % "--code TMP/nope --pyz TMP/p.pyz ", 2, "is not a directory",
      files={"p.pyz": "PK"}, env=CREDS),
    R("kaggle-bad-dataset", PUSH % "--dataset nope --pyz TMP/p.pyz ", 2, "OWNER/DATASET-SLUG", files={"p.pyz": "PK"},
      env=CREDS),
    R("kaggle-no-command", "kaggle push TMP/k --name r", 2, "Missing argument 'COMMAND...'", env=CREDS),
    R("kaggle-status-no-credentials", "kaggle status r", 3, "no Kaggle credentials", env=NO_KAGGLE),
    R("kaggle-pull-bad-name", "kaggle pull ../x TMP/d", 2, "invalid run name", env=CREDS),
]


# issue 21: keep
POOL = {"cfg/boxes.toml": BOX + 'pool = "p"\n'}  # box b, a spare of pool p (behind a closed port)
RECOVER = "run b --durable /d --recover"


def launch_record(**policy):
    """A launch record of run kp on box b (what `onboxctl run --recover` writes); `provision` names a script in the
    row's dir (the callable gets the record's path, and finds the row's dir from it)."""
    def write(path):
        root = path[:path.index("/cfg/")]
        p = dict(pool="p", provision=None, lost_after=0, max_recoveries=10, max_at_risk=None, backoff=0.1,
                 backoff_max=1, tries=1, provision_timeout=1)
        p.update({k: (os.path.join(root, v) if k == "provision" and isinstance(v, str) else v) for k, v in
                  policy.items()})
        if isinstance(p["provision"], str):
            p["provision"] = [p["provision"]]
        doc = {"schema": "onboxctl.launch/1", "run": "kp", "boxes": ["b"], "command": ["python", "t.py"], "policy": p,
               "onbox_args": ["--durable", "/d"], "onbox_env": {}, "durable": "/d", "heartbeat_interval": 1.0,
               "timeout": 5.0, "created": 0}
        with open(path, "w") as f:
            json.dump(doc, f)
    return write


def script(text):
    def write(path):
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + text + "\n")
        os.chmod(path, 0o755)
    return write


KP = "cfg/runs/kp/launch.json"
ROWS += [
    R("keep-pool-unknown", RECOVER + " pool:nosuch -- true", 2, "unknown pool 'nosuch'", files=POOL),
    R("keep-pool-spec", RECOVER + " a100 -- true", 2, "expected pool:NAME", files=POOL),
    R("keep-pool-name", RECOVER + " pool:a! -- true", 2, "invalid pool name", files=POOL),
    R("keep-no-durable", "run b --recover pool:p -- true", 2, "--recover needs --durable", files=POOL),
    R("keep-alone", "run b --lost-after 3s -- true", 2, "--lost-after goes with --recover", files=POOL),
    R("keep-lost-after", RECOVER + " pool:p --lost-after soon -- true", 2, "is not a duration", files=POOL),
    R("keep-at-risk-neg", RECOVER + " pool:p --max-at-risk -5m -- true", 2, "is not a duration", files=POOL),
    R("keep-provision-missing", RECOVER + " pool:p --provision /nonexistent/new-box.sh -- true", 2, "no such file",
      files=POOL),
    R("keep-provision-not-exec", RECOVER + " pool:p --provision TMP/fan -- true", 2, "is not executable",
      files=dict(POOL, fan="#!/bin/sh\n")),
    R("keep-provision-quote", [*RECOVER.split(), "pool:p", "--provision", "'new-box", "--", "true"], 2,
      "No closing quotation", files=POOL),
    R("keep-provision-path", RECOVER + " pool:p --provision no-such-command-xyz -- true", 2, "no such command on PATH",
      files=POOL),
    R("keep-code", RECOVER + " pool:p --code /nonexistent/code -- true", 2, "--code /nonexistent/code is not a dir",
      files=POOL),
    R("keep-box-pool", ["box", "add", "x", "--host", "h", "--pool", "a b"], 2, "invalid pool name"),
    R("keep-inv-pool", "box ls", 2, "pool must be a string", files={"cfg/boxes.toml": BOX + "pool = 5\n"}),
    R("keep-run-unknown", "keep --once --run nosuch", 2, "no launch record for run nosuch"),
    R("keep-interval", "keep --interval 0", 2, "not a number of seconds"),
    R("keep-launch-garbage", "keep --once", 2, "launch record", files={KP: "{not json", **BOXES}),
    R("keep-launch-deep", "keep --once", 2, "nests more than 64 levels",
      files={KP: "[" * 100000 + "]" * 100000, **BOXES}),
    R("keep-launch-fifo", "keep --once", 2, "FIFO", files={KP: fifo, **BOXES}),
    R("keep-launch-field", "keep --once", 2, "max_recoveries is 'many'",
      files={KP: launch_record(max_recoveries="many"), **BOXES}),
    R("keep-recovery-garbage", "keep --once", 2, "is not a recovery record",
      files={KP: launch_record(), "cfg/runs/kp/recovery.json": '{"state": "watching"}', **BOXES}),
    R("keep-recovery-state", "keep --once", 2, "state 'sleeping' is not one of",
      files={KP: launch_record(), "cfg/runs/kp/recovery.json": '{"schema": "onboxctl.recovery/1", "run": "kp", '
             '"state": "sleeping", "boxes": ["b"], "recoveries": 0}', **BOXES}),
    R("keep-runs-file", "keep --once", 2, "is not a directory", files={"cfg/runs": "x"}),
    R("keep-status-record", "status --max-at-risk 1x", 2, "is not a duration"),
]

def snapshot(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = "dir"
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            if os.path.islink(p) or not os.path.isfile(p):  # a symlink (to /dev/zero), a FIFO: named, never read
                out[os.path.relpath(p, root)] = "link %s" % os.readlink(p) if os.path.islink(p) else "special"
                continue
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_clear_line(tmp_path, row):
    root = str(tmp_path / "w")
    os.makedirs(os.path.join(root, "cfg"))
    for rel, content in row.files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if callable(content):
            content(path)
        else:
            with open(path, "wb") as f:
                f.write(content if isinstance(content, bytes) else str(content).encode())
    if row.wrap and (os.geteuid() != 0 or shutil.which("unshare") is None):
        pytest.skip("needs root and unshare for a read-only mount")
    argv = [a.replace("TMP", root) for a in row.argv]
    cmd = [PY, "-m", "controller", *argv]
    if row.wrap:
        cmd = [a.replace("TMP", root) for a in row.wrap] + cmd
    env = subprocess_env(dict({"ONBOX_CONFIG_DIR": os.path.join(root, "cfg"), "HOME": os.path.join(root, "home"),
                               "ONBOX_HOME": os.path.join(root, "onbox"), "ONBOX_SSH_CONTROL_DIR": os.path.join(
                                   root, "cm"), "ONBOX_SSH_CONNECT_TIMEOUT": "2", "XDG_CONFIG_HOME": root},
                              **{k: v.replace("TMP", root) for k, v in row.env.items()}))
    before = snapshot(root)
    r = subprocess.run(cmd, input=row.stdin, env=env, capture_output=True, timeout=60)
    err = r.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, "TRACEBACK\n" + err
    assert r.returncode == row.code, "exit %d, not %d:\n%s%s" % (r.returncode, row.code, r.stdout.decode(), err)
    lines = [line for line in err.splitlines() if line.startswith(("onboxctl: ", "Error: "))]
    assert len(lines) == 1, err  # one message line (a hint may follow)
    assert row.says in err, err
    assert snapshot(root) == before, "something was written"


# issue 21: keep (rows that act: a lost box, no spare, a provision command that fails one way each). Each ends the run
# failed_no_resource: exit 1, one line; the reason on stdout; nothing launched, nothing deleted, and nothing written
# but the run's recovery record (and the ssh control dir its probe made).
class KeepRow(NamedTuple):
    id: str
    files: Dict[str, object]
    says: str


KEEP_ROWS = [
    KeepRow("keep-provision-garbage", {KP: launch_record(provision="prov"), "prov": script("echo 'Welcome!'"),
                                       **BOXES}, "printed 'Welcome!' as its last line, not a JSON object"),
    KeepRow("keep-provision-exit", {KP: launch_record(provision="prov"), "prov": script("echo 'no gpus' >&2; exit 7"),
                                    **BOXES}, "exited 7: no gpus"),
    KeepRow("keep-provision-hangs", {KP: launch_record(provision="prov"), "prov": script("exec sleep 30"), **BOXES},
            "did not print a box within 1 s"),
    KeepRow("keep-provision-bad-box", {KP: launch_record(provision="prov"),
                                       "prov": script('echo \'{"host": "-oProxyCommand=x", "name": "n"}\''), **BOXES},
            "must not start with '-'"),
    KeepRow("keep-provision-vanished", {KP: launch_record(provision="prov"), **BOXES},
            "cannot be started: it is not there"),
    KeepRow("keep-spare-down", {KP: launch_record(), "cfg/boxes.toml": BOX + '[boxes.s]\nhost = "127.0.0.1"\nport = 9\n'
                                'pool = "p"\n'}, "spare s: cannot reach box s"),
]


@pytest.mark.parametrize("row", KEEP_ROWS, ids=[r.id for r in KEEP_ROWS])
def test_keep_that_cannot_recover_says_so_in_one_line_and_launches_nothing(tmp_path, row):
    root = str(tmp_path / "w")
    os.makedirs(os.path.join(root, "cfg"))
    for rel, content in row.files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if callable(content):
            content(path)
        else:
            with open(path, "w") as f:
                f.write(str(content))
    env = subprocess_env({"ONBOX_CONFIG_DIR": os.path.join(root, "cfg"), "HOME": os.path.join(root, "home"),
                          "ONBOX_HOME": os.path.join(root, "onbox"), "ONBOX_SSH_CONTROL_DIR": os.path.join(root, "cm"),
                          "ONBOX_SSH_CONNECT_TIMEOUT": "2", "XDG_CONFIG_HOME": root})
    before = snapshot(root)
    r = subprocess.run([PY, "-m", "controller", "keep", "--once"], env=env, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("onboxctl: ")]
    assert lines == ["onboxctl: 1 run(s) could not be recovered: kp"], r.stderr
    assert row.says in r.stdout, r.stdout
    after = snapshot(root)
    assert set(before) <= set(after), "something was deleted"
    changed = {k for k in after if after[k] != before.get(k)}
    assert {k for k in changed if not k.startswith("cm")} == {"cfg/runs/kp/recovery.json"}, changed
    with open(os.path.join(root, "cfg", "runs", "kp", "recovery.json")) as f:
        rec = json.load(f)
    assert rec["state"] == "failed_no_resource" and rec["recoveries"] == 0 and not rec["history"]


# onboxctl stop of a box that does not answer: an unknown name (an ssh alias that resolves nowhere) and an inventory
# box behind a closed port. Exit 3, one line naming the box; nothing written but the ssh control dir.
@pytest.mark.parametrize("box,files", [("nosuch.invalid", {}), ("b", BOXES)], ids=["stop-unknown-box",
                                                                                   "stop-box-down"])
def test_stop_of_a_box_that_does_not_answer_is_one_line_exit_3(tmp_path, box, files):
    root = str(tmp_path / "w")
    os.makedirs(os.path.join(root, "cfg"))
    for rel, content in files.items():
        with open(os.path.join(root, rel), "w") as f:
            f.write(content)
    env = subprocess_env({"ONBOX_CONFIG_DIR": os.path.join(root, "cfg"), "HOME": os.path.join(root, "home"),
                          "ONBOX_HOME": os.path.join(root, "onbox"), "ONBOX_SSH_CONTROL_DIR": os.path.join(root, "cm"),
                          "ONBOX_SSH_CONNECT_TIMEOUT": "2", "XDG_CONFIG_HOME": root})
    before = snapshot(root)
    r = subprocess.run([PY, "-m", "controller", "stop", box, "r", "--wait"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 3, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("onboxctl: ")]
    assert len(lines) == 1 and lines[0].startswith("onboxctl: cannot reach box %s " % box), r.stderr
    assert "hint: " in r.stderr and r.stdout == ""
    after = snapshot(root)
    assert {k: v for k, v in after.items() if not k.startswith("cm")} == before
