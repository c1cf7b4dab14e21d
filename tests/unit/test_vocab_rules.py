"""The run's vocabulary is spelled once, in onbox/vocab.py (issue 34: the tracker's own set of ended states lacked
`fenced`, and a fenced run read SILENT). Checked on the code's syntax tree, so that docstrings and comments may name a
state freely; a string is a state's spelling where it is used as one:

- an operand of a comparison (`state == "fenced"`, `st in ("done", "stopped")`);
- one of two or more state words in a tuple, list or set (a set of states);
- one of two or more state words among a dict's keys (a table keyed by state);

and any string that is a schema id (`onbox.status/1`, `onboxctl.recovery/1`) is its spelling wherever it stands.
The words are onbox.vocab's run states and the words older agents wrote into a beat's state.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Dict, Iterator, List, Tuple

from onbox import vocab
from tests.conftest import REPO_ROOT

# "exited" (an older beat's word for an ended run) is left out: it is also how a process's end is reported
# (controller/keeper/provision_reaper.py), and vocab.ENDED_STATES and CLEAN_STATES are the only sets that hold it.
STATE_WORDS = (frozenset(vocab.RUN_STATES) | vocab.ENDED_STATES | vocab.BEAT_LIVE_STATES) - {vocab.EXITED}
SCHEMA_ID = re.compile(r"onbox(ctl)?\.[a-z0-9_.]+/[0-9]+")
VOCAB = os.path.join("onbox", "vocab.py")
# Files that may spell a word of the vocabulary, each with why.
ALLOWED: Dict[str, str] = {
    os.path.join("controller", "kaggle", "kernel_main.py"):
        "runs on Kaggle's own Python with the standard library only: it imports nothing of onbox",
    os.path.join("controller", "commands", "kaggle.py"):
        "NEXT is keyed by a Kaggle session's outcome, the words kernel_main.py (above) writes, not by a run state",
}


def _words(node: ast.AST) -> List[ast.Constant]:
    """The state words a node is, or holds as the elements of a literal tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in STATE_WORDS:
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                and e.value in STATE_WORDS]
    return []


def _docstrings(tree: ast.AST) -> set:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            out.update(id(s.value) for s in body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    return out


def spellings(source: str, where: str = "<source>") -> List[Tuple[int, str, str]]:
    """(line, the string, how it is used) for each spelling of a state or a schema id in `source`."""
    tree = ast.parse(source, where)
    docs = _docstrings(tree)
    found: Dict[int, Tuple[int, str, str]] = {}

    def add(nodes: List[ast.Constant], how: str) -> None:
        for c in nodes:
            found.setdefault(id(c), (c.lineno, c.value, how))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                add(_words(operand), "compared as a state")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            words = _words(node)
            if len(words) >= 2:
                add(words, "in a set of states")
        elif isinstance(node, ast.Dict):
            keys = [w for k in node.keys if k is not None for w in _words(k)]
            if len(keys) >= 2:
                add(keys, "a key of a table of states")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                and SCHEMA_ID.fullmatch(node.value):
            add([node], "a schema id")
    return sorted(found.values())


def source_files() -> Iterator[str]:
    for top in ("onbox", "controller"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO_ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for fn in sorted(filenames):
                if fn.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, fn), REPO_ROOT)


def test_the_vocabulary_is_spelled_only_in_onbox_vocab():
    bad = []
    for rel in source_files():
        if rel == VOCAB or rel in ALLOWED:
            continue
        with open(os.path.join(REPO_ROOT, rel), encoding="utf-8") as f:
            bad += ["%s:%d: %r %s" % (rel, line, text, how) for line, text, how in spellings(f.read(), rel)]
    assert not bad, ("spell these through onbox.vocab (import the name; a state word used as something else "
                     "gets a name where its own vocabulary lives):\n" + "\n".join(bad))


def test_every_allowed_file_exists_and_says_why():
    for rel, why in ALLOWED.items():
        assert os.path.isfile(os.path.join(REPO_ROOT, rel)) and len(why) > 20, rel


def test_the_checker_catches_a_planted_spelling():
    planted = '''
"""A docstring may say fenced, done and onbox.status/1."""
# so may a comment: state == "fenced"
ENDED = {"done", "failed", "fenced"}
HINTS = {"done": "pull it", "preempted": "push again"}
SCHEMA = "onboxctl.launches/1"

def ended(doc):
    """Spelled "fenced" in a docstring."""
    return doc.get("state") == "fenced" or doc.get("schema") != "onbox.status/1"
'''
    got = [(line, text, how) for line, text, how in spellings(planted)]
    assert got == [(4, "done", "in a set of states"), (4, "failed", "in a set of states"),
                   (4, "fenced", "in a set of states"), (5, "done", "a key of a table of states"),
                   (5, "preempted", "a key of a table of states"), (6, "onboxctl.launches/1", "a schema id"),
                   (10, "fenced", "compared as a state"), (10, "onbox.status/1", "a schema id")]


def test_the_checker_leaves_other_uses_of_the_words_alone():
    clean = '''
from onbox import vocab
log("the run is done")               # a message
emit("fenced", holder=h)             # an event's name, not a state
summary = {"done": 1}                # one word is not a table of states
KINDS = ("queued", "running")        # one state word among others
if state == vocab.FENCED and doc.get("schema") == vocab.SCHEMA_STATUS:
    pass
'''
    assert spellings(clean) == []
