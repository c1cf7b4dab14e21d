"""The keeper's half of the bad-input sweep (issue 30): hostile provision outputs, hostile records and a tracker that
cannot be read, fed to the real `onboxctl keep` in a subprocess.

- provision rows: run kp's box is lost (a closed port) and its provision command misbehaves one way each; `keep
  --once` ends the run failed_no_resource: exit 1, one `onboxctl:` line, the reason on stdout (control characters
  shown as escapes), no traceback, nothing written but the run's recovery record (and the ssh control dir), nothing
  the hostile output asked for done (no `pwned` file), and no process left: not the command, not what it started
  (found by a mark in the keeper's environment, and by the pids the scripts write for the ones that scrub it);
- record rows: a hand-edited or hostile launch/recovery record: exit 2, one line naming the file, nothing written;
- `onboxctl run --recover ... --provision-timeout` out of 1s-24h: exit 2 naming the flag;
- real sshd boxes: a provision that prints a legitimate box (allowed options only) still gets the run launched there
  (the false-positive side of the allow-list); and a healthy run whose box stops answering ssh while the tracker
  answers garbage, an error, a document nested too deep, or nothing, is never taken over (item 2): it keeps
  training, and once the tracker answers that its beats are late, the keeper recovers it on the spare as before.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Dict, List, NamedTuple

import pytest

from tests.conftest import subprocess_env
from tests.hosts.sshd_box import close_masters
from tests.hosts.tracker_stub import TrackerStub
from tests.processes import kill_exact, pid_alive, start_ticks, with_env

pytestmark = pytest.mark.integration

PY = sys.executable
BOX = '[boxes.b]\nhost = "127.0.0.1"\nport = 9\n'  # closed port: a box that is lost
KP = "cfg/runs/kp/launch.json"
MB300 = 300 * 1000 * 1000


def launch_record(**policy: Any) -> Callable[[str], None]:
    """Run kp on box b, lost at its first failed probe, one try to find a box; `provision` names a script in the
    row's dir."""
    def write(path: str) -> None:
        root = path[:path.index("/cfg/")]
        p = dict(pool="p", provision=None, lost_after=0, max_recoveries=10, max_at_risk=None, backoff=0.1,
                 backoff_max=1, tries=1, provision_timeout=10)
        p.update(policy)
        if isinstance(p["provision"], str):
            p["provision"] = [os.path.join(root, p["provision"])]
        doc = {"schema": "onboxctl.launch/1", "run": "kp", "boxes": ["b"], "command": ["python", "t.py"], "policy": p,
               "onbox_args": ["--durable", "/d"], "onbox_env": {}, "durable": "/d", "heartbeat_interval": 1.0,
               "timeout": 5.0, "created": 0}
        with open(path, "w") as f:
            json.dump(doc, f)
    return write


def script(text: str) -> Callable[[str], None]:
    """A provision script; TMP in it is the row's dir."""
    def write(path: str) -> None:
        root = path[:path.rindex("/")]
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + text.replace("TMP", root) + "\n")
        os.chmod(path, 0o755)
    return write


def prints(**doc: Any) -> Callable[[str], None]:
    """A provision script printing the box `doc` describes (TMP in a value is the row's dir)."""
    line = json.dumps(dict({"name": "gpu-7", "host": "203.0.113.7"}, **doc))
    return script("echo '%s'" % line)


def snapshot(root: str) -> Dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = "dir"
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            if os.path.islink(p) or not os.path.isfile(p):
                out[os.path.relpath(p, root)] = "special"
                continue
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def place(root: str, files: Dict[str, Any]) -> None:
    os.makedirs(os.path.join(root, "cfg"), exist_ok=True)
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if callable(content):
            content(path)
        else:
            with open(path, "w") as f:
                f.write(str(content))
            os.chmod(path, 0o600)


def keeper_env(root: str, mark: str, **extra: str) -> Dict[str, str]:
    return subprocess_env(dict({"ONBOX_CONFIG_DIR": os.path.join(root, "cfg"), "HOME": os.path.join(root, "home"),
                                "ONBOX_HOME": os.path.join(root, "onbox"), "ONBOX_SSH_CONTROL_DIR": os.path.join(
                                    root, "cm"), "ONBOX_SSH_CONNECT_TIMEOUT": "2", "XDG_CONFIG_HOME": root,
                                "KEEPER_ROW_MARK": mark}, **extra))


def _ssh_master(pid: int) -> bool:
    """The keeper's own ssh connection master (ControlPersist): kept on purpose, closed by the test (close_masters)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return b"ControlMaster=yes" in f.read()
    except OSError:
        return False


def left_running(root: str, mark: str) -> List[int]:
    """Every process the row started that still runs: by the mark, and by the pids its scripts wrote."""
    found = {pid for pid, _ in with_env("KEEPER_ROW_MARK", mark) if not _ssh_master(pid)}
    pids = os.path.join(root, "pids")
    if os.path.exists(pids):
        with open(pids) as f:
            found |= {int(x) for x in f.read().split() if pid_alive(int(x))}
    return sorted(found)


def stop_left(root: str, mark: str) -> None:
    """What the code under test left: the row caused it, the row stops it (by pid and start time)."""
    for pid in left_running(root, mark):
        start = start_ticks(pid)
        if start is not None:
            kill_exact(pid, start)


# -- provision rows ------------------------------------------------------------------------------------------------
class ProvRow(NamedTuple):
    id: str
    prov: Callable[[str], None]
    says: str
    timeout: float = 10
    env: Dict[str, str] = {}
    files: Dict[str, Any] = {}


LEAVE = "sleep 300 & echo $! >> TMP/pids; (setsid sleep 301 & echo $! >> TMP/pids); " \
        "(setsid env -i sleep 302 & echo $! >> TMP/pids); sleep 0.2"
EVIL_CONF = "ProxyCommand sh -c 'touch TMP/pwned'\n"
PROV_ROWS = [
    ProvRow("opt-proxycommand", prints(options=["ProxyCommand=touch TMP/pwned"]),
            "ssh option ProxyCommand is never taken from a provision's output: it runs a command on this machine"),
    ProvRow("opt-localcommand", prints(options=["PermitLocalCommand=yes", "LocalCommand=touch TMP/pwned"]),
            "ssh option PermitLocalCommand is never taken"),
    ProvRow("opt-include", prints(options=["Include=TMP/evil.conf"]), "ssh option Include is never taken",
            files={"evil.conf": EVIL_CONF}),
    ProvRow("opt-match-exec", prints(options=['Match=exec "touch TMP/pwned"']), "ssh option Match is never taken"),
    ProvRow("opt-knownhostscommand", prints(options=["KnownHostsCommand=/bin/sh -c 'touch TMP/pwned'"]),
            "ssh option KnownHostsCommand is never taken"),
    ProvRow("opt-proxyjump", prints(options=["ProxyJump=attacker@203.0.113.66"]),
            "ssh option ProxyJump is never taken from a provision's output: a second host"),
    ProvRow("opt-forwardagent", prints(options=["ForwardAgent=yes"]), "it hands your ssh agent to the box"),
    ProvRow("opt-sendenv", prints(options=["SendEnv=*"]), "it sends this machine's environment"),
    ProvRow("opt-unknown", prints(options=["CanonicalizeHostname=always"]),
            "ssh option CanonicalizeHostname is not one a provision may set"),
    ProvRow("opt-knownhosts-outside", prints(options=["UserKnownHostsFile=TMP/outside"]),
            "ssh option UserKnownHostsFile=", ),
    ProvRow("identity-outside", prints(identity="/etc/shadow"), "identity /etc/shadow is not under"),
    ProvRow("profile-traversal", prints(profile="../../../tmp/evil"), "profile '../../../tmp/evil'"),
    ProvRow("leftovers-exit-0", script(LEAVE + "; echo 'Welcome!'"), "printed 'Welcome!' as its last line"),
    ProvRow("leftovers-timeout", script(LEAVE + "; exec sleep 60"), "did not print a box within 2 s", timeout=2),
    ProvRow("stdout-300mb-small-tmpdir", script("head -c %d /dev/zero | tr '\\0' x; echo; echo 'no box today'"
                                                % MB300),
            "(its stdout cut to its last 64 KiB of 300.0 MB)", timeout=120, env={"TMPDIR": "TMP/no-such-tmp"}),
    ProvRow("stderr-300mb", script("head -c %d /dev/zero | tr '\\0' x >&2; echo >&2; echo 'out of capacity' >&2; "
                                   "exit 1" % MB300),
            "exited 1: out of capacity (its stderr cut to its last 64 KiB of 300.0 MB)",
            timeout=120, env={"TMPDIR": "TMP/no-such-tmp"}),  # 300 MB through a pipe: 10 s were too few under load
    ProvRow("stderr-escapes", script("printf 'renting\\n\\033]0;PWNED-TITLE\\007\\033[2J' >&2; exit 1"),
            "exited 1: \\x1b]0;PWNED-TITLE\\x07\\x1b[2J"),
]


@pytest.mark.parametrize("row", PROV_ROWS, ids=[r.id for r in PROV_ROWS])
def test_a_hostile_provision_is_one_line_does_nothing_it_asked_and_leaves_nothing_running(tmp_path, row):
    root = str(tmp_path / "w")
    place(root, dict({KP: launch_record(provision="prov", provision_timeout=row.timeout), "prov": row.prov,
                      "cfg/boxes.toml": BOX}, **row.files))
    mark = uuid.uuid4().hex
    before = snapshot(root)
    env = keeper_env(root, mark, **{k: v.replace("TMP", root) for k, v in row.env.items()})
    try:
        r = subprocess.run([PY, "-m", "controller", "keep", "--once"], env=env, capture_output=True, timeout=120)
        out, err = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
        assert "Traceback" not in err, err
        assert r.returncode == 1, (out, err)
        assert [ln for ln in err.splitlines() if ln.startswith("onboxctl: ")] == \
            ["onboxctl: 1 run(s) could not be recovered: kp"], err
        assert row.says in out, out
        assert not any(c in out + err for c in "\x1b\x07\x00"), "a control character reached the terminal"
        assert not os.path.exists(os.path.join(root, "pwned"))
        assert left_running(root, mark) == []
        after = snapshot(root)
        assert set(before) <= set(after), "something was deleted"
        changed = {k for k in after if after[k] != before.get(k)}
        assert {k for k in changed if not k.startswith(("cm", "pids"))} == {"cfg/runs/kp/recovery.json"}, changed
        with open(os.path.join(root, "cfg", "runs", "kp", "recovery.json")) as f:
            rec = json.load(f)
        assert rec["state"] == "failed_no_resource" and not rec["history"]
        if row.id.startswith("leftovers"):
            said = [e["text"] for e in rec["events"] if e["kind"] == "provision_leftovers"]
            assert said and "stopped 3 process(es)" in said[0], rec["events"]
    finally:
        stop_left(root, mark)


# -- record rows ---------------------------------------------------------------------------------------------------
class RecRow(NamedTuple):
    id: str
    files: Dict[str, Any]
    says: str
    code: int = 2


def recovery(**over: Any) -> str:
    doc = {"schema": "onboxctl.recovery/1", "run": "kp", "state": "watching", "boxes": ["b"], "recoveries": 0}
    doc.update(over)
    return json.dumps(doc)


def chmod(mode: int, inner: Callable[[str], None]) -> Callable[[str], None]:
    def write(path: str) -> None:
        inner(path)
        os.chmod(path, mode)
    return write


ESC = "\x1b]0;PWNED\x07"
REC_ROWS = [
    RecRow("launch-provision-timeout-0", {KP: launch_record(provision=["/bin/true"], provision_timeout=0)},
           "provision_timeout 0s is out of range (--provision-timeout takes 1s to 24h)"),
    RecRow("launch-provision-timeout-year", {KP: launch_record(provision=["/bin/true"], provision_timeout=3.2e7)},
           "(--provision-timeout takes 1s to 24h)"),
    RecRow("launch-box-option", {KP: lambda p: (launch_record()(p), _edit(p, boxes=["-oProxyCommand=touch x"]))},
           "is not a box name"),
    RecRow("launch-box-escape", {KP: lambda p: (launch_record()(p), _edit(p, boxes=["b" + ESC]))},
           "is not a box name"),
    RecRow("launch-number-huge", {KP: lambda p: (launch_record()(p), _edit(p, heartbeat_interval=10 ** 400))},
           "heartbeat_interval is"),
    RecRow("launch-writable-by-others", {KP: chmod(0o666, launch_record(provision=["/bin/true"]))},
           "is writable by others (mode 0666): refused"),
    RecRow("recovery-to-box-option", {KP: launch_record(), "cfg/runs/kp/recovery.json": recovery(
        state="recovering", current={"id": 1, "kind": "elsewhere", "reason": "lost", "from_boxes": ["b"],
                                     "to_boxes": ["-oProxyCommand=x"], "phases": {"detected": 1.0}})},
           "to_boxes: box '-oProxyCommand=x' is not a box name"),
    RecRow("recovery-time-nan", {KP: launch_record(), "cfg/runs/kp/recovery.json": recovery().replace(
        '"recoveries": 0', '"recoveries": 0, "suspect_since": NaN')}, "suspect_since must be a time in seconds"),
    RecRow("run-dir-escape", {"cfg/runs/k%s/launch.json" % ESC: launch_record()}, "which is not a run name"),
]


def _edit(path: str, **over: Any) -> None:
    with open(path) as f:
        doc = json.load(f)
    doc.update(over)
    with open(path, "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize("row", REC_ROWS, ids=[r.id for r in REC_ROWS])
def test_a_hostile_record_is_one_line_naming_it_and_nothing_is_written(tmp_path, row):
    root = str(tmp_path / "w")
    place(root, dict(row.files, **{"cfg/boxes.toml": BOX}))
    mark = uuid.uuid4().hex
    before = snapshot(root)
    r = subprocess.run([PY, "-m", "controller", "keep", "--once"], env=keeper_env(root, mark), capture_output=True,
                       timeout=60)
    out, err = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    assert r.returncode == row.code, (out, err)
    lines = [ln for ln in err.splitlines() if ln.startswith("onboxctl: ")]
    assert len(lines) == 1 and row.says in lines[0], err
    assert not any(c in out + err for c in "\x1b\x07"), "a control character reached the terminal"
    assert {k: v for k, v in snapshot(root).items() if not k.startswith("cm")} == before, "something was written"
    assert left_running(root, mark) == []


@pytest.mark.parametrize("value", ["0s", "0", "500ms", "25h", "2d"])
def test_run_refuses_a_provision_timeout_out_of_range_naming_the_flag(tmp_path, value):
    root = str(tmp_path / "w")
    place(root, {"cfg/boxes.toml": BOX + 'pool = "p"\n', "prov": script("true")})
    before = snapshot(root)
    r = subprocess.run([PY, "-m", "controller", "run", "b", "--durable", "/d", "--recover", "pool:p", "--provision",
                        os.path.join(root, "prov"), "--provision-timeout", value, "--", "true"],
                       env=keeper_env(root, uuid.uuid4().hex), capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr and r.returncode == 2, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("Error: ")]
    assert "'--provision-timeout'" in line and "it takes 1s to 24h" in line, line
    assert snapshot(root) == before


def test_a_provision_timeout_in_range_is_taken_by_run(tmp_path):
    """Beside the refusal: 1s and 24h are in range (the run is then refused only for its closed port: exit 3)."""
    root = str(tmp_path / "w")
    place(root, {"cfg/boxes.toml": BOX + 'pool = "p"\n', "prov": script("true")})
    for value in ("1s", "24h"):
        r = subprocess.run([PY, "-m", "controller", "run", "b", "--durable", "/d", "--recover", "pool:p",
                            "--provision", os.path.join(root, "prov"), "--provision-timeout", value, "--", "true"],
                           env=keeper_env(root, uuid.uuid4().hex), capture_output=True, text=True, timeout=60)
        assert "--provision-timeout" not in r.stderr and r.returncode == 3, r.stderr


# -- real sshd boxes -----------------------------------------------------------------------------------------------
def _ssh_kill_run(box: Any, run: str) -> None:
    """Stop the run's agent and trainer on `box` (a test box: its home is here), by pid and start time."""
    try:
        with open(os.path.join(box.home, ".onbox", "runs", run, "state.json")) as f:
            st = json.load(f)
    except (OSError, ValueError):
        return
    for pid_key, start_key in (("agent_pid", "agent_start_time"), ("child_pid", "child_start_time")):
        pid, start = st.get(pid_key), st.get(start_key)
        if isinstance(pid, int) and isinstance(start, int):
            kill_exact(pid, start)


def test_a_provision_printing_a_legitimate_box_gets_the_run_launched_there(tmp_path, sshd_box, onbox_pyz):
    """The allow-list's false-positive side, for real: the provision prints a real sshd box with the options a
    platform script sets (Port, User, an IdentityFile under the config dir, host-key options with the known hosts
    under it too, ConnectTimeout, ServerAliveInterval): the keeper takes it, pushes onbox.pyz, audits it and the
    run starts there; nothing of the provision runs on."""
    root = str(tmp_path / "w")
    cfg = os.path.join(root, "cfg")
    os.makedirs(os.path.join(cfg, "keys"))
    key = os.path.join(cfg, "keys", "gpu-7")
    shutil.copy(sshd_box.client_key, key)
    os.chmod(key, 0o600)
    durable = os.path.join(root, "durable")
    os.makedirs(durable)
    line = json.dumps({"name": "gpu-7", "host": sshd_box.listen, "port": sshd_box.port, "user": "root",
                       "identity": key, "python": sys.executable,
                       "options": ["StrictHostKeyChecking=accept-new",
                                   "UserKnownHostsFile=%s" % os.path.join(cfg, "rented_known_hosts"),
                                   "ConnectTimeout=5", "ServerAliveInterval=5", "LogLevel=ERROR"]})

    def rec(path: str) -> None:
        launch_record(provision="prov", provision_timeout=60)(path)
        _edit(path, command=[PY, "-c", "import time; time.sleep(600)"], onbox_args=["--durable", durable],
              durable=durable, pyz=onbox_pyz, workdir=root)

    place(root, {KP: rec, "prov": script("sleep 300 & echo $! >> TMP/pids\necho '%s'" % line),
                 "cfg/boxes.toml": BOX})
    mark = uuid.uuid4().hex
    cm = tempfile.mkdtemp(prefix="ok", dir="/tmp")  # short: unix socket paths are limited to ~104 bytes
    try:
        r = subprocess.run([PY, "-m", "controller", "keep", "--once"],
                           env=keeper_env(root, mark, ONBOX_SSH_CONTROL_DIR=cm), capture_output=True, text=True,
                           timeout=300)
        assert "Traceback" not in r.stderr and r.returncode == 0, r.stdout + r.stderr
        with open(os.path.join(cfg, "runs", "kp", "recovery.json")) as f:
            rec_doc = json.load(f)
        assert rec_doc["boxes"] == ["gpu-7"] and rec_doc["recoveries"] == 1, rec_doc["events"]
        assert os.path.isdir(os.path.join(sshd_box.home, ".onbox", "runs", "kp"))
        assert left_running(root, mark) == []  # the provision's background sleep was stopped
        kinds = [e["kind"] for e in rec_doc["events"]]
        assert "provision_leftovers" in kinds and "relaunched" in kinds, kinds
    finally:
        _ssh_kill_run(sshd_box, "kp")
        stop_left(root, mark)
        close_masters(cm)
        shutil.rmtree(cm, ignore_errors=True)


@pytest.mark.slow
def test_a_healthy_run_whose_sshd_stopped_is_never_taken_over_while_its_tracker_cannot_be_read(netns_boxes, tmp_path,
                                                                                                onbox_pyz):
    """Item 2 for real: b0 trains, its sshd stops (the agent and the trainer go on); the keeper's tracker answers, in
    turn, garbage, an HTTP error, a run list nested past any bound, no run list, a liveness it does not know, and
    nothing at all (a closed port). For each, `keep --once` passes spanning more than --lost-after: the run is
    waited for (SUSPECT, `tracker_unreadable` said once), the spare is never touched, and b0's run trains on. Then
    the tracker answers that the run's beats are late: the keeper recovers it on the spare, as it always did."""
    from tests.hosts.keeper_rig import Rig

    b0, s0 = netns_boxes(2)
    rig = Rig(tmp_path, onbox_pyz)
    stub = TrackerStub().start()
    try:
        rig.add("b0", b0)
        rig.add("s0", s0, pool="p")
        rig.ctl("push", "b0", "--pyz", rig.pyz)
        rig.launch("b0", lost_after="2s")
        from tests.polling import wait_for

        wait_for(lambda: len(rig.committed()) >= 1, 60, "a durable commit on b0")
        b0.stop()  # sshd only: the detached agent and its trainer go on
        record_path = os.path.join(rig.cfg, "runs", rig.run, "recovery.json")
        with open(record_path, "rb") as f:
            fresh = f.read()
        answers: List[Any] = [
            (200, b"<html>502 Bad Gateway</html>"), (500, b'{"detail": "database is locked"}'),
            (200, b'{"runs": [' + b"[" * 3000 + b"]" * 3000 + b"]}"), (200, {"error": "maintenance"}),
            (200, {"runs": [{"run": rig.run, "box": "b0", "liveness": "probably-fine"}]}), None]
        for answer in answers:
            with open(record_path, "wb") as f:  # each answer meets the run as the launch left it
                f.write(fresh)
            url = "http://127.0.0.1:9" if answer is None else stub.url
            if answer is not None:
                stub.answer(*answer)
            step_before = _newest_step(rig)
            for _ in range(2):  # 2.5 s apart: the second pass is past --lost-after (2 s)
                r = rig.ctl("keep", "--once", "--tracker", url, check=False)
                assert r.returncode == 0 and "Traceback" not in r.stderr, (answer, r.stdout, r.stderr)
                time.sleep(2.5)  # the keeper's clock must pass --lost-after between two passes: real time
            with open(record_path) as f:
                doc = json.load(f)
            kinds = [e["kind"] for e in doc["events"]]
            assert doc["state"] == "suspect" and doc["recoveries"] == 0, (answer, doc["message"])
            assert kinds.count("tracker_unreadable") == 1 and "declared_lost" not in kinds, (answer, kinds)
            assert not os.path.exists(os.path.join(s0.home, ".onbox", "runs")), answer  # the spare: untouched
            assert rig.state("b0").get("state") == "running", answer
            wait_for(lambda before=step_before: _newest_step(rig) > before, 30, "b0's run training on")
        # the control: a tracker that answers, saying the beats are late, gets the box lost and the run recovered
        with open(record_path, "wb") as f:
            f.write(fresh)
        stub.runs({"run": rig.run, "box": "b0", "liveness": "late", "state": "running"})
        rig.ctl("keep", "--once", "--tracker", stub.url)
        time.sleep(2.5)
        r = rig.ctl("keep", "--once", "--tracker", stub.url)
        with open(record_path) as f:
            doc = json.load(f)
        assert doc["boxes"] == ["s0"] and "declared_lost" in [e["kind"] for e in doc["events"]], r.stdout
    finally:
        stub.stop()
        rig.close()


def _newest_step(rig: Any) -> int:
    """The newest step b0's trainer printed (its output log), 0 before the first."""
    log = os.path.join(rig.boxes["b0"].home, ".onbox", "runs", rig.run, "output.log")
    step = 0
    try:
        with open(log, errors="replace") as f:
            for line in f.readlines()[-50:]:
                try:
                    step = max(step, int(json.loads(line).get("step", 0)))
                except (ValueError, AttributeError, TypeError):
                    continue
    except OSError:
        pass
    return step

