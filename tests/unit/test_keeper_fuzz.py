"""Property: whatever a provision command prints, whatever the launch and recovery records on disk hold, and whatever
a tracker answers, the keeper raises nothing but its own clear refusals, writes nothing outside the run's recovery
record, never judges a healthy run lost, and leaves no process behind (the house manifest fuzz's shape,
tests/unit/test_ckpt_untrusted_fuzz.py, for the keeper's surfaces).

- provision output: random and near-valid JSON lines (hostile ssh options, paths, names, types) into box_from_line:
  a box is only ever accepted with options no oracle here finds dangerous; and, fewer draws as each one runs a real
  script, drawn stdout/stderr bytes, exit codes and background children through run_provision: a Box or a
  ProvisionFailed, one line without control characters, nothing left running;
- records: near-valid launch.json and recovery.json (hostile box names, numbers past any bound, deep nesting, wrong
  types) read by a keeper pass and by `status`'s view: a record problem or a pass, never an exception; nothing
  written but recovery.json; a run whose box answers alive is never declared lost;
- tracker answers: drawn run lists served by a real HTTP server and read through the real World.beats, with the
  run's box failing ssh for longer than --lost-after: declared lost only when the answer is a whole, readable run
  list that says the run's beats are late, silent or ended, or that it has none.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import uuid
from typing import Any, Dict

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controller.boxes.inventory import Box
from controller.keeper.loop import Keeper
from controller.keeper.provision import ProvisionFailed, box_from_line, run_provision
from controller.keeper.records import RecordStore
from controller.keeper.view import apply_keeper
from onbox.clock import FakeClock
from tests.hosts.tracker_stub import TrackerStub
from tests.processes import kill_exact, pid_alive, start_ticks, with_env
from tests.unit.test_keeper import FakeWorld, alive
from tests.unit.test_keeper_tracker import BoxDown, record

ESC = "\x1b]0;PWNED\x07"
HOSTILE_STR = ["-oProxyCommand=touch pwned", "b" + ESC, "", " ", "a\nb", "a b", "../../x", "/etc/shadow", "~/../x",
               "%d/x", "${HOME}/x", "x" * 300, "ok", "gpu-7", "runpod", "late", "ok\x00"]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 10 ** 30), st.floats(allow_nan=False,
                                                                                     allow_infinity=False),
                      st.sampled_from(HOSTILE_STR), st.text(max_size=8))
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                       max_size=3), max_leaves=10)
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400, "-0", "0"]


def with_raw(doc: Dict[str, Any], raw: Dict[str, str]) -> str:
    """json.dumps(doc), then some values replaced by raw JSON text (NaN, 1e400, a 400-digit integer, deep lists)."""
    text = json.dumps(doc)
    for key, value in raw.items():
        text = text.replace('"%s": "RAW"' % key, '"%s": %s' % (key, value))
    return text


# -- provision output ----------------------------------------------------------------------------------------------
OPTION_KEYS = ["ProxyCommand", "LocalCommand", "PermitLocalCommand", "Include", "Match", "KnownHostsCommand",
               "ProxyJump", "RemoteCommand", "ForwardAgent", "SendEnv", "ControlPath", "PKCS11Provider",
               "IdentityFile", "UserKnownHostsFile", "Port", "User", "ConnectTimeout", "StrictHostKeyChecking",
               "proxycommand", "PROXYCOMMAND", "IdentityAgent", "Hostname", "LogLevel"]
DANGEROUS = {"proxycommand", "localcommand", "permitlocalcommand", "include", "match", "knownhostscommand",
             "proxyjump", "remotecommand", "forwardagent", "sendenv", "setenv", "controlpath", "controlmaster",
             "pkcs11provider", "securitykeyprovider", "identityagent", "hostname", "localforward", "remoteforward",
             "dynamicforward", "proxyusefdpass"}
options = st.lists(st.one_of(st.builds(lambda k, v: "%s=%s" % (k, v), st.sampled_from(OPTION_KEYS),
                                       st.one_of(st.sampled_from([*HOSTILE_STR, "22", "yes", "accept-new",
                                                                  "~/.ssh/id", "/dev/null"]),
                                                 st.text(max_size=10))),
                             json_leaf), max_size=3)
VALID_LINE = {"name": "gpu-7", "host": "203.0.113.7", "port": 22, "user": "root",
              "options": ["StrictHostKeyChecking=accept-new"]}
FIELD_VALUES = {  # a legitimate value about as often as a hostile one
    "name": st.one_of(st.sampled_from(["gpu-8", "a.b_c"]), st.sampled_from(HOSTILE_STR), json_leaf),
    "host": st.one_of(st.sampled_from(["10.0.0.9", "box.example"]), st.sampled_from(HOSTILE_STR), json_leaf),
    "port": st.one_of(st.integers(-1, 70000), json_leaf), "user": st.one_of(st.sampled_from(HOSTILE_STR), json_leaf),
    "identity": st.one_of(st.sampled_from([*HOSTILE_STR, "~/.ssh/k", "~/.ssh/../.ssh/k"]), json_leaf),
    "options": st.one_of(options, options, json_any), "profile": st.one_of(st.sampled_from(HOSTILE_STR), json_leaf),
    "python": st.one_of(st.sampled_from([*HOSTILE_STR, "/opt/conda/bin/python"]), json_leaf)}


@st.composite
def provision_lines(draw: Any) -> str:
    """Mostly a line the keeper would take, with one or two fields replaced (where a missing check lets a hostile
    value through); else any JSON, any text, or a document nested too deep."""
    doc: Dict[str, Any] = dict(VALID_LINE)
    for key in draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=2, unique=True)):
        doc[key] = draw(FIELD_VALUES[key])
    if draw(st.integers(0, 3)):
        return json.dumps(doc)
    return draw(st.one_of(json_any.map(json.dumps), st.text(max_size=40),
                          st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)))


def _key_dirs():
    return [os.path.realpath(os.environ["ONBOX_CONFIG_DIR"]), os.path.realpath(os.path.expanduser("~/.ssh"))]


@pytest.fixture
def keeper_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path / "cfg"))
    os.makedirs(str(tmp_path / "home" / ".ssh"))
    os.makedirs(str(tmp_path / "cfg"))
    return tmp_path


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=provision_lines())
def test_no_provision_line_gives_a_box_with_a_dangerous_option(keeper_home, line):
    try:
        box = box_from_line(line, "a100", "./new-box.sh")
    except ProvisionFailed as e:
        event("refused")
        assert "\n" not in e.message and "\x1b" not in e.message and "\x00" not in e.message
        return
    event("accepted")
    for opt in box.options:
        key, _, value = opt.partition("=")
        assert key.lower() not in DANGEROUS, opt
        assert not any(ord(c) < 32 or ord(c) == 127 for c in value), opt
        if key.lower() in ("identityfile", "userknownhostsfile") and value != "/dev/null":
            path = os.path.realpath(os.path.expanduser(value))
            assert any(path.startswith(d + os.sep) for d in _key_dirs()), opt
    assert not box.host.startswith("-") and not any(c.isspace() for c in box.host)
    if box.identity is not None:
        path = os.path.realpath(os.path.expanduser(box.identity))
        assert any(path.startswith(d + os.sep) for d in _key_dirs())
    assert box.profile is None or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?",
                                               box.profile)


run_scripts = st.fixed_dictionaries({
    "stdout": st.one_of(provision_lines().map(lambda s: s.encode("utf-8", "surrogateescape") + b"\n"),
                        st.binary(max_size=200)),
    "stderr": st.one_of(st.binary(max_size=200), st.just(ESC.encode() + b"\n")),
    "rc": st.sampled_from([0, 0, 1, 3, 255]),
    "leave": st.sampled_from(["", "sleep 300 &", "(setsid sleep 300 &)", "(setsid env -i sleep 300 & echo $! >> $PIDS)",
                              "exec sleep 300"]),
})


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(drawn=run_scripts)
def test_no_provision_run_raises_anything_else_says_a_control_character_or_leaves_a_process(keeper_home, drawn):
    with tempfile.TemporaryDirectory(prefix="onbox-fuzz-") as root:
        for name in ("stdout", "stderr"):
            with open(os.path.join(root, name), "wb") as f:
                f.write(drawn[name])
        script = os.path.join(root, "new-box.sh")
        with open(script, "w") as f:
            f.write("#!/bin/sh\n%s\ncat %s/stdout\ncat %s/stderr >&2\nexit %d\n" % (
                drawn["leave"], root, root, drawn["rc"]))
        os.chmod(script, 0o755)
        mark, pids = uuid.uuid4().hex, os.path.join(root, "pids")
        try:
            try:
                run_provision([script], 0.5, {"KEEPER_FUZZ_MARK": mark, "PIDS": pids}, "a100", grace=0.2)
                event("box")
            except ProvisionFailed as e:
                event("refused")
                assert "\n" not in e.message and "\x1b" not in e.message and "\x07" not in e.message
            left = [p for p, _ in with_env("KEEPER_FUZZ_MARK", mark)]
            if os.path.exists(pids):
                with open(pids) as f:
                    left += [int(x) for x in f.read().split() if pid_alive(int(x))]
            assert left == [], "left running: %s" % left
        finally:
            for p, start in with_env("KEEPER_FUZZ_MARK", mark):  # whatever the code under test left: stopped here
                kill_exact(p, start)
            if os.path.exists(pids):
                with open(pids) as f:
                    for x in f.read().split():
                        s = start_ticks(int(x))
                        if s is not None:
                            kill_exact(int(x), s)


# -- records -------------------------------------------------------------------------------------------------------
POLICY = {"pool": "p", "provision": None, "lost_after": 0, "max_recoveries": 10, "max_at_risk": None, "backoff": 0.1,
          "backoff_max": 1, "tries": 1, "provision_timeout": 600}
LAUNCH = {"schema": "onboxctl.launch/1", "run": "kp", "boxes": ["b"], "command": ["python", "t.py"],
          "policy": POLICY, "onbox_args": [], "onbox_env": {}, "durable": "/d", "heartbeat_interval": 1.0,
          "timeout": 5.0, "created": 0}
RECOVERY = {"schema": "onboxctl.recovery/1", "run": "kp", "state": "watching", "boxes": ["b"], "recoveries": 0,
            "suspect_since": None, "last_seen": {"step": 5, "durable_step": 4, "durable_at": 1.0, "state": "running"},
            "events": [], "history": [], "current": None, "event_seq": 0, "published": 0}
CURRENT = {"id": 1, "kind": "elsewhere", "reason": "lost", "from_boxes": ["b"], "to_boxes": [], "phases": {
    "detected": 1.0}, "tries": 0}
value = st.one_of(json_any, st.sampled_from(HOSTILE_STR), st.just("RAW"))
raw_value = st.sampled_from([*RAW_NUMBERS, "[" * 200 + "]" * 200])


@st.composite
def records(draw: Any) -> Dict[str, str]:
    launch = json.loads(json.dumps(LAUNCH))
    keep = json.loads(json.dumps(RECOVERY))
    raw: Dict[str, str] = {}
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.sampled_from(["launch", "policy", "recovery", "current", "last_seen"]))
        if where == "current" and not isinstance(keep.get("current"), dict):
            keep["current"] = json.loads(json.dumps(CURRENT))
        doc = {"launch": launch, "policy": launch["policy"], "recovery": keep, "last_seen": keep["last_seen"],
               "current": keep["current"]}[where]
        if not isinstance(doc, dict):
            continue
        key = draw(st.sampled_from([*sorted(doc), "extra"]))
        doc[key] = draw(value)
        if doc[key] == "RAW":
            raw[key] = draw(raw_value)
    if draw(st.booleans()):
        keep["state"] = draw(st.sampled_from(["watching", "suspect", "recovering", "ended", "failed_launch"]))
    out = {"launch.json": with_raw(launch, raw)}
    if draw(st.booleans()):
        out["recovery.json"] = with_raw(keep, raw)
    return out


def snapshot(root: str, skip: str) -> Dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for fn in files:
            p = os.path.join(dirpath, fn)
            if p == skip:
                continue
            with open(p, "rb") as f:
                out[p] = hashlib.sha256(f.read()).hexdigest()
    return out


@settings(max_examples=300, deadline=None)
@given(files=records())
def test_no_record_makes_a_pass_raise_write_outside_or_judge_a_healthy_run_lost(files):
    with tempfile.TemporaryDirectory(prefix="onbox-fuzz-") as root:
        store = RecordStore(os.path.join(root, "cfg"))
        os.makedirs(os.path.join(store.root, "kp"))
        for name, text in files.items():
            with open(os.path.join(store.root, "kp", name), "w", encoding="utf-8", errors="surrogateescape") as f:
                f.write(text)
        before = snapshot(root, skip=store.keep_path("kp"))
        clock = FakeClock(start_wall=1000.0)
        inv = {"b": Box(name="b", host="h"), "s": Box(name="s", host="h2", pool="p")}
        world = FakeWorld(clock, {"b": [alive("b", "kp")]}, inv, spares={"s": None})
        said = []
        report = Keeper(store, world, clock=clock, say=said.append).tick()
        event("problem" if report.problems else "pass")
        for p in report.problems:
            assert "\n" not in str(p["text"]) and "\x1b" not in str(p["text"])
        assert "declared_lost" not in [e.get("kind") for e in said]  # the box answers: never lost
        assert snapshot(root, skip=store.keep_path("kp")) == before
        apply_keeper([], store)  # `onboxctl status` reads the same records: no exception either


# -- tracker answers -----------------------------------------------------------------------------------------------
LIVE = ["ok", "late", "silent", "ended", "unknown", "OK", None, 5, ""]
entries = st.one_of(json_any, st.fixed_dictionaries({"run": st.one_of(st.sampled_from(["gpt", "other", "gpt" + ESC]),
                                                                      json_leaf)},
                                                    optional={"liveness": st.one_of(st.sampled_from(LIVE), json_leaf),
                                                              "latest": json_any, "box": json_leaf,
                                                              "problem": json_leaf, "unreadable": json_leaf}))
near_entry = st.builds(lambda run, live, latest: {"run": run, "liveness": live, "box": "gpu1", "latest": latest},
                       st.sampled_from(["gpt", "gpt", "other"]), st.sampled_from(LIVE),
                       st.one_of(st.none(), st.just({"progress": {"step": 3}}), json_any))
answers = st.one_of(
    st.builds(lambda es, skipped: json.dumps({"runs": es, "skipped_rows": skipped}), st.lists(near_entry, max_size=3),
              st.sampled_from([0, 0, 1, -1, True, None, "2"])),
    st.fixed_dictionaries({"runs": st.one_of(st.lists(entries, max_size=4), json_any)},
                          optional={"skipped_rows": st.one_of(st.integers(-1, 3), json_leaf)}).map(json.dumps),
    json_any.map(json.dumps), st.text(max_size=30), st.integers(60, 3000).map(lambda n: "[" * n + "]" * n))
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def may_be_lost(body: str) -> bool:
    """The oracle: a whole, clean run list that lists the run's beats as late, silent or ended, or lists it not."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return False
    if isinstance(doc, list):  # the reader takes a bare list as the run list (an older tracker's answer)
        doc = {"runs": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        return False
    skipped = doc.get("skipped_rows", 0)
    clean = skipped is None or (isinstance(skipped, int) and not isinstance(skipped, bool) and skipped <= 0)
    runs = doc["runs"]
    mine = [e for e in runs if isinstance(e, dict) and e.get("run") == "gpt"]
    if mine:  # listed: its own liveness decides, whatever else the list holds
        return len(mine) == 1 and mine[0].get("liveness") in ("late", "silent", "ended")
    return clean and all(isinstance(e, dict) and isinstance(e.get("run"), str) and RUN_NAME.fullmatch(e["run"])
                         for e in runs)


@pytest.fixture(scope="module")
def stub():
    s = TrackerStub().start()
    yield s
    s.stop()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=answers, status=st.sampled_from([200, 200, 200, 500, 401]))
def test_no_tracker_answer_makes_the_keeper_take_over_a_box_whose_beats_it_cannot_read(stub, body, status):
    stub.answer(status, body.encode("utf-8", "surrogateescape"))
    with tempfile.TemporaryDirectory(prefix="onbox-fuzz-") as root:
        store = RecordStore(root)
        record(store)
        world = BoxDown(stub.url)
        clock = FakeClock(start_wall=1000.0)
        k = Keeper(store, world, clock=clock)
        for _ in range(5):  # 20 s of failed probes: past --lost-after (15 s)
            k.tick()
            clock.advance(5.0)
        lost = bool(world.launched)
        event("lost" if lost else "kept")
        if lost:
            assert status == 200 and may_be_lost(body), body[:200]
        for e in store.load("gpt")[1].events:
            assert "\x1b" not in e["text"] and "\n" not in e["text"]
