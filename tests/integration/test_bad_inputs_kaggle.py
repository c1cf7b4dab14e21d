"""The Kaggle half of the bad-input sweep (issue 30): `onboxctl kaggle` fed what a careless user types and what a
hostile kernel output holds, through the real CLI in a subprocess.

The table: each row is refused before anything is written or sent (the row's whole directory byte-identical
after, the kaggle CLI pointed at a closed port, so a row that reached for the network fails otherwise), exit 2,
one `onboxctl: ...` line naming what is wrong, no traceback. Then the surfaces that need the real kaggle CLI 2.2.5
talking to the local server that answers like Kaggle (tests/hosts/kaggle_api.py): secret-looking files of --code
left out of the pushed kernel and named, a public push of one refused without --yes-publish-secrets, --no-push with
no network at all, an output listing names that lead out of DEST (never fetched), and Kaggle's text with terminal
escapes in it (shown as escapes).
"""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import tarfile
import urllib.parse
from typing import Dict, List, NamedTuple

import pytest

from controller.kaggle import cli as kaggle_cli
from controller.kaggle import kernel_main
from tests.conftest import subprocess_env
from tests.hosts.kaggle_api import FakeKaggle
from tests.integration.test_bad_inputs_onboxctl import snapshot

pytestmark = pytest.mark.integration
PY = sys.executable
# every row's kaggle CLI (were it ever run) talks through a proxy at a closed port: nothing leaves the machine
OFFLINE = {"KAGGLE_API_ENVIRONMENT": "LOCALHOST", "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY":
           "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "no_proxy": "", "NO_PROXY": "", "KAGGLE_USERNAME": "", "KAGGLE_KEY": "", "KAGGLE_CONFIG_DIR": "TMP/kc"}
CREDS = dict(OFFLINE, KAGGLE_USERNAME="tester", KAGGLE_KEY="k")
PUSH = "kaggle push TMP/k --name r --pyz TMP/p.pyz %s-- python3 t.py"
CODE = {"p.pyz": "PK", "c/train.py": "print(1)\n", "c/.env": "WANDB_API_KEY=x\n", "c/kaggle.json": "{}"}


class Row(NamedTuple):
    id: str
    argv: List[str]
    says: str
    files: Dict[str, str] = {}
    env: Dict[str, str] = {}


def R(id, args, says, files=None, env=None):
    return Row(id, (PUSH % args).split() if "kaggle" not in args else args.split(), says, dict(files or {"p.pyz": "PK"}),
               dict(env or CREDS))


ROWS = [
    # item 13: the session's `onbox run` options, checked here by the agent's own parser and validation
    R("onbox-arg-grace-nan", "--onbox-arg=--grace=nan ", "--onbox-arg --grace=nan: --grace must be a number"),
    R("onbox-arg-grace-inf", "--onbox-arg --grace=inf ", "--grace must be a number from 0 to 86400"),
    R("onbox-arg-bogus", "--onbox-arg=--bogus ", "--onbox-arg --bogus: `onbox run` refuses it: No such option"),
    R("onbox-arg-no-value", "--onbox-arg=--grace ", "Option '--grace' requires an argument"),
    R("onbox-arg-ckpt-root", "--onbox-arg=--ckpt-dir=/ ", "--ckpt-dir / is the root of the filesystem"),
    R("onbox-arg-ckpt-usr", "--onbox-arg=--ckpt-dir=/usr ", "--ckpt-dir /usr is a system directory"),
    R("onbox-arg-ckpt-up", "--onbox-arg=--ckpt-dir=../../../.. ", "(/ on Kaggle) is the root of the filesystem"),
    R("onbox-arg-name", "--onbox-arg=--name=other ", "--name is set by the kernel's script"),
    R("onbox-arg-durable", "--onbox-arg=--durable=/mnt/d ", "--durable is set by the kernel's script"),
    R("onbox-arg-profile", "--onbox-arg=--profile=runpod ", "--profile is set by the kernel's script"),
    R("onbox-arg-word", "--onbox-arg=python ", "python is no `onbox run` option"),
    R("onbox-arg-dashdash", "--onbox-arg=-- ", "`--` ends the options"),
    R("onbox-arg-deadline", "--onbox-arg=--deadline=soon ", "--deadline 'soon'"),
    R("onbox-arg-restart", "--onbox-arg=--restart=sometimes ", "Invalid value for '--restart'"),
    R("onbox-arg-no-creds", "--onbox-arg=--bogus ", "No such option: --bogus", env=OFFLINE),  # before credentials
    # item 7: --include-secret and --public
    R("include-no-code", "--include-secret .env ", "--include-secret goes with --code"),
    R("include-names-nothing", "--code TMP/c --include-secret train.py ", "--include-secret train.py names no "
      "secret-looking file", files=CODE),
    R("include-typo", "--code TMP/c --include-secret .evn ", "--include-secret .evn names no secret-looking file",
      files=CODE),
    R("include-outside", "--code TMP/c --include-secret /etc/passwd ", "is not inside the code directory",
      files=CODE),
    R("include-up", "--code TMP/c --include-secret ../p.pyz ", "names no file inside the code directory", files=CODE),
    R("public-secret", "--public --code TMP/c --include-secret .env ", "--public would publish secret-looking files "
      "of --code TMP/c: .env", files=CODE),
    R("public-secret-dir", "--public --code TMP/c --include-secret .ssh ", "--public would publish secret-looking "
      "files of --code TMP/c: .ssh/", files=dict(CODE, **{"c/.ssh/id_rsa": "k"})),
    R("public-secret-env", "--public --onbox-arg=--env=WANDB_API_KEY=x ", "--public would publish the value of --env "
      "WANDB_API_KEY"),
    # item 13: --no-push asks Kaggle nothing, so it needs no credentials, only a name
    R("no-push-no-owner", "--no-push ", "--no-push without Kaggle credentials needs --owner", env=OFFLINE),
    # a dataset mounted where the kernel's previous output is looked for
    R("dataset-own-slug", "--dataset eve/onbox-r ", "--dataset eve/onbox-r has the kernel's own slug"),
]


def onboxctl_env(root, extra=None):
    return subprocess_env(dict({"ONBOX_CONFIG_DIR": os.path.join(root, "cfg"), "HOME": os.path.join(root, "home"),
                                "ONBOX_HOME": os.path.join(root, "onbox"), "XDG_CONFIG_HOME": root},
                               **{k: v.replace("TMP", root) for k, v in (extra or {}).items()}))


def place(root, files):
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_kaggle_input_is_one_clear_line_before_anything_is_written_or_sent(tmp_path, row):
    root = str(tmp_path / "w")
    os.makedirs(os.path.join(root, "cfg"))
    place(root, row.files)
    before = snapshot(root)
    r = subprocess.run([PY, "-m", "controller", *[a.replace("TMP", root) for a in row.argv]],
                       env=onboxctl_env(root, row.env), capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    err = r.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, "TRACEBACK\n" + err
    assert r.returncode == 2, "exit %d, not 2:\n%s%s" % (r.returncode, r.stdout.decode(), err)
    lines = [line for line in err.splitlines() if line.startswith(("onboxctl: ", "Error: "))]
    assert len(lines) == 1, err
    assert row.says.replace("TMP", root) in err, err
    assert snapshot(root) == before, "something was written"


# --- against the real kaggle CLI and a local server that answers like Kaggle ---------------------------------
LEGIT = {"train.py": "print(1)\n", "src/keyboard.py": "x\n", "environment.py": "x\n", "tokenizer.json": "{}\n",
         "id_map.csv": "1\n", "id_rsa.pub": "ssh-ed25519 AAAA\n", ".env.example": "WANDB_API_KEY=\n"}
SECRET = {".env": "WANDB_API_KEY=hunter2\n", "kaggle.json": '{"username": "me", "key": "k"}\n',
          ".ssh/id_rsa": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl\n-----END OPENSSH PRIVATE KEY-----\n",
          ".git/config": "[remote \"origin\"]\n\turl = https://me:ghp_token@github.com/me/x\n"}
REF = "tester/onbox-r"


def need_kaggle_cli():
    exe = kaggle_cli.executable()
    if not (os.path.isabs(exe) and os.access(exe, os.X_OK)):
        pytest.skip("the kaggle CLI is not installed (the controller extra pins it; it needs Python 3.11+)")


class HostileKaggle(FakeKaggle):
    """Kaggle's output listing with extra names the server serves: what a session's code can make it list."""

    extra: List[str] = []

    def _list_output(self, h, ref, v, body):
        real = self._send

        def send(h2, code, doc):
            for name in self.extra:
                doc["files"].append({"fileName": name, "url": "http://localhost/blob/%s/%d/%s" % (
                    ref, v["number"], urllib.parse.quote(name, safe=""))})
            real(h2, code, doc)
        self._send = send  # type: ignore[method-assign]
        try:
            super()._list_output(h, ref, v, {**body, "pageSize": 200})
        finally:
            del self._send

    def handle_get(self, h):
        name = urllib.parse.unquote(urllib.parse.urlsplit(h.path).path.split("/", 5)[-1])
        if name not in self.extra:
            return super().handle_get(h)
        data = b"planted\n"
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


@pytest.fixture
def kaggle(tmp_path):
    fake = HostileKaggle(str(tmp_path / "kaggle-server")).start()
    try:
        yield fake
    finally:
        fake.stop()


def ctl(tmp_path, kaggle, *args, timeout=120):
    env = onboxctl_env(str(tmp_path), kaggle.client_env(str(tmp_path / "kc")))
    env.pop("KAGGLE_USERNAME", None)
    env.pop("KAGGLE_KEY", None)
    return subprocess.run([PY, "-m", "controller", *args], env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def packed(version):
    """The names in the --code archive of a saved version's script."""
    text = version["text"]
    head = text.split("\n\n", 1)[0]
    ns: dict = {}
    exec(compile(head[head.index("SPEC = "):], "head", "exec"), ns)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(ns["CODE_B64"])), mode="r:gz") as t:
        return sorted(t.getnames())


def test_secret_looking_files_stay_out_of_the_kernel_and_a_public_one_needs_an_explicit_yes(tmp_path, kaggle,
                                                                                             onbox_pyz):
    need_kaggle_cli()
    place(str(tmp_path / "code"), {**LEGIT, **SECRET})
    push = ["kaggle", "push", str(tmp_path / "k"), "--name", "r", "--code", str(tmp_path / "code"), "--pyz",
            onbox_pyz, "--accelerator", "cpu"]
    r = ctl(tmp_path, kaggle, *push, "--json", "--", "python3", "train.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert packed(kaggle.newest(REF)) == sorted(LEGIT)
    doc = json.loads(r.stdout)
    assert sorted(f["path"] for f in doc["secrets_left_out"]) == [".env", ".git/", ".ssh/", "kaggle.json"]
    (warning,) = [ln for ln in r.stderr.splitlines() if ln.startswith("onboxctl: warning: ")]
    assert all(p in warning for p in (".env (", ".git/ (", ".ssh/ (", "kaggle.json (")), warning
    assert "hunter2" not in kaggle.newest(REF)["text"]

    kaggle.newest(REF)["status"] = "COMPLETE"
    r = ctl(tmp_path, kaggle, *push, "--public", "--include-secret", ".env", "--", "python3", "train.py")
    assert r.returncode == 2 and "--public would publish secret-looking files" in r.stderr, r.stdout + r.stderr
    assert len(kaggle.kernels[REF]) == 1 and "Traceback" not in r.stderr  # refused before Kaggle was asked

    r = ctl(tmp_path, kaggle, *push, "--public", "--include-secret", ".env", "--yes-publish-secrets", "--", "python3",
            "train.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert packed(kaggle.newest(REF)) == sorted([*LEGIT, ".env"]) and kaggle.newest(REF)["request"]["isPrivate"] is False
    assert "sending secret-looking path(s) of --code" in r.stderr and ".env (an environment file)" in r.stderr


def test_no_push_asks_kaggle_nothing_and_needs_no_credentials(tmp_path, onbox_pyz):
    root = str(tmp_path)
    place(root, {"c/train.py": "print(1)\n"})
    argv = [PY, "-m", "controller", "kaggle", "push", os.path.join(root, "k"), "--name", "r", "--no-push", "--code",
            os.path.join(root, "c"), "--pyz", onbox_pyz, "--json"]
    wrap = ["unshare", "--net", "--"] if os.geteuid() == 0 and subprocess.run(
        ["unshare", "--net", "true"], capture_output=True).returncode == 0 else []  # no network at all, where it can
    for extra, owner in (({}, ["--owner", "tester"]), ({"KAGGLE_USERNAME": "me", "KAGGLE_KEY": "k"}, [])):
        env = onboxctl_env(root, dict(OFFLINE, **extra))
        r = subprocess.run([*wrap, *argv, *owner, "--", "python3", "train.py"], env=env, capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert (doc["pushed"], doc["continuing"], doc["version"]) == (False, None, None)
        with open(os.path.join(root, "k", "kernel-metadata.json")) as f:
            meta = json.load(f)
        assert meta["id"] == "%s/onbox-r" % (owner[1] if owner else "me")
        assert meta["kernel_sources"] == [meta["id"]]  # a later version resumes from the one before; a first skips it


def committed_output(working, run, step):
    """A session's output: one committed checkpoint of `run` at `step` (a real manifest) and the outcome."""
    import hashlib

    d = os.path.join(working, kernel_main.DURABLE_DIR, run, "checkpoints", "step_%05d" % step)
    os.makedirs(d)
    data = b"weights\n"
    with open(os.path.join(d, "data.dat"), "wb") as f:
        f.write(data)
    with open(os.path.join(d, "MANIFEST.json"), "w") as f:
        json.dump({"schema": "onbox.manifest/1", "name": "step_%05d" % step, "kind": "dir", "hash": "sha256",
                   "step": step, "created": 2.0, "files": [{"path": "data.dat", "size": len(data),
                                                            "sha256": hashlib.sha256(data).hexdigest()}]}, f)


def complete(kaggle, working, log_lines, failure=None):
    kaggle.kernels[REF] = [{"number": 1, "text": "", "request": {}, "kernel_sources": [], "saved_at": 0.0,
                            "status": "ERROR" if failure else "COMPLETE", "failure": failure, "output": working,
                            "log": json.dumps([{"stream_name": "stdout", "time": 0.1, "data": line + "\n"}
                                               for line in log_lines])}]


def tree_of(path):
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


def test_a_pull_never_fetches_a_name_that_leads_out_of_dest_or_holds_an_escape(tmp_path, kaggle):
    need_kaggle_cli()
    working = str(tmp_path / "out")
    committed_output(working, "r", 7)
    complete(kaggle, working, ["training"])
    planted = tmp_path / "planted"
    kaggle.extra = ["%s/r/../../../../../../../../../..%s" % (kernel_main.DURABLE_DIR, planted),
                    "%s/r/checkpoints/step_00007/../../../../../../escape.txt" % kernel_main.DURABLE_DIR,
                    str(planted / "abs"), "%s/r/checkpoints/\x1b]0;PWNED\x07/MANIFEST.json" % kernel_main.DURABLE_DIR,
                    "%s/r/logs/a\\..\\..\\b" % kernel_main.DURABLE_DIR]
    before = tree_of(str(tmp_path))
    r = ctl(tmp_path, kaggle, "kaggle", "pull", "r", str(tmp_path / "home"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "\x1b" not in r.stdout + r.stderr and "\x07" not in r.stdout + r.stderr
    assert tree_of(str(tmp_path / "home")) == ["r", "r/checkpoints", "r/checkpoints/step_00007",
                                               "r/checkpoints/step_00007/MANIFEST.json",
                                               "r/checkpoints/step_00007/data.dat", "r/kaggle-session.log"]
    new = set(tree_of(str(tmp_path))) - set(before)
    assert {p for p in new if not p.startswith(("home", "cfg", "kc", "kaggle-server"))} == set(), new
    assert not planted.exists()


def test_kaggles_text_is_printed_with_its_control_characters_escaped(tmp_path, kaggle):
    need_kaggle_cli()
    working = str(tmp_path / "out")
    os.makedirs(working)
    outcome = {"schema": kernel_main.OUTCOME_SCHEMA, "run": "r", "outcome": ["\x1b[2J"], "exit_code": "\x1b]0;X\x07"}
    complete(kaggle, working, ["step 1 \x1b]0;PWNED-TITLE\x07", "\x1b[2Jforged", kernel_main.LOG_PREFIX +
                                json.dumps(outcome)], failure="oom \x1b]0;PWNED\x07")
    for args in (["status", "r"], ["logs", "r"], ["logs", "r", "--raw"]):
        r = ctl(tmp_path, kaggle, "kaggle", *args)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "Traceback" not in out, out
        assert "\x1b" not in out and "\x07" not in out, repr(out)
        assert "\\x1b" in out or "\\u001b" in out, repr(out)
    r = ctl(tmp_path, kaggle, "kaggle", "status", "r", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["failure"] == "oom \x1b]0;PWNED\x07", r.stdout + r.stderr
