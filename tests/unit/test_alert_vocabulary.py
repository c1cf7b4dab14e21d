"""One alert vocabulary (issue 32, item 5): every alert code the agent's rules, the supervisor's warnings, the
checkpoint hook and onboxctl raise is a kind of onbox.vocab, with its severity; every kind there is raised
somewhere; and what a beat or a box says is read back through the one reader (alert_from)."""
from __future__ import annotations

import os
import re

from onbox import vocab
from tests.conftest import REPO_ROOT

RAISERS = {  # where alerts are spelled, and how a code looks there
    "onbox/telemetry/alerts.py": r'Alert\(\s*"([a-z_]+)"',
    "onbox/supervisor/notes.py": r'"code": "([a-z_]+)"',
    "controller/goodput/atrisk.py": r'^ALERT = "([a-z_]+)"',
}


def _source(rel):
    with open(os.path.join(REPO_ROOT, rel), encoding="utf-8") as f:
        return f.read()


def test_every_code_raised_is_a_kind_of_the_vocabulary():
    found = set()
    for rel, pattern in RAISERS.items():
        codes = set(re.findall(pattern, _source(rel), re.M))
        assert codes, "no alert code found in %s: has the way it spells them changed?" % rel
        found |= codes
    notes = _source("onbox/supervisor/notes.py")  # the node resume problems are raised under their event's name
    found |= set(re.findall(r'"(node_resume_[a-z]+)"', notes))
    assert found - set(vocab.ALERT_KINDS) == set(), "add these to onbox/vocab.py's ALERT_KINDS"


def test_every_kind_of_the_vocabulary_is_raised_somewhere():
    code = ""
    for top in ("onbox", "controller"):
        for dirpath, _dirs, files in os.walk(os.path.join(REPO_ROOT, top)):
            for fn in files:
                if fn.endswith(".py") and fn != "vocab.py":
                    code += _source(os.path.relpath(os.path.join(dirpath, fn), REPO_ROOT))
    named = {v: k for k, v in vars(vocab).items() if k.isupper() and isinstance(v, str)}  # NO_CHECKPOINT, ...
    dead = [k for k in vocab.ALERT_KINDS if '"%s"' % k not in code and "vocab.%s" % named.get(k) not in code]
    assert dead == []


def test_severities_are_two_and_a_reader_keeps_an_unknown_code_but_never_an_unknown_severity():
    assert vocab.SEVERITIES == ("warning", "critical")
    assert all(k.severity in vocab.SEVERITIES for k in vocab.ALERT_KINDS.values())
    assert vocab.alert_from({"code": "a_newer_kind", "severity": "fatal", "message": "m"}) == {
        "code": "a_newer_kind", "severity": "warning", "message": "m", "hint": ""}
    assert vocab.alert_from({"code": "sync_failed"})["severity"] == "critical"  # its kind's default
    assert vocab.alert_from("loss_spike")["code"] == "loss_spike"  # an older beat's bare code
    assert vocab.alert_from({"severity": "critical"}) is None and vocab.alert_from(7) is None
    long = vocab.alert_from({"code": "x" * 100, "message": "m" * 1000})
    assert len(long["code"]) == vocab.CODE_CHARS and len(long["message"]) == vocab.MESSAGE_CHARS
