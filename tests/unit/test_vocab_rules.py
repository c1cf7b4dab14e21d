"""The run's vocabulary is spelled once, in onbox/vocab.py (issue 34: the tracker's own set of ended states lacked
`fenced`, and a fenced run read SILENT). Checked on the code's syntax tree, so that docstrings and comments may name a
state freely; a string is a state's spelling where it is used as one:

- an operand of a comparison (`state == "fenced"`, `st in ("done", "stopped")`);
- one of two or more state words in a tuple, list or set (a set of states);
- one of two or more state words among a dict's keys (a table keyed by state);

and any string that is a schema id (`onbox.status/1`, `onboxctl.recovery/1`) is its spelling wherever it stands.
The words are onbox.vocab's run states and the words older agents wrote into a beat's state.

The event types: every event written is one of onbox.vocab's tables, and a reader names it from there.

- (a) the type an emitter writes is in the table: the agent's `emit("type", ...)` (also `self.journal.emit`,
  `ctx.emit`, and the lease's `_say`/`_emit`), under controller/keeper/ the keeper's `emit(keep, "kind", text)`,
  `keep.event(now, "kind", text)` and `say({"kind": ...})`. A type given as a name is a forwarder's (its caller's
  type is checked where it is spelled) or a module constant (its value is checked); an event built ahead of its
  emit (a list of pending ones) takes its type from vocab (onbox.vocab.EV_...).
- (b) an event's type or kind read (`ev.get("type")`, `e["kind"]`, or a name bound from one) is compared only with
  vocab's names: a literal type, or a module's set or table of them, on the other side is a spelling.

Every file is parsed once and walked once (`_scan`, cached for all the tests here).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
from typing import Dict, FrozenSet, Iterator, List, Set, Tuple

from onbox import vocab
from tests.conftest import REPO_ROOT

# "exited" (an older beat's word for an ended run) is left out: it is also how a process's end is reported
# (controller/keeper/provision_reaper.py), and vocab.ENDED_STATES and CLEAN_STATES are the only sets that hold it.
STATE_WORDS = (frozenset(vocab.RUN_STATES) | vocab.ENDED_STATES | vocab.BEAT_LIVE_STATES) - {vocab.EXITED}
EVENT_WORDS = frozenset(vocab.EVENT_TYPES) | frozenset(vocab.KEEPER_EVENTS)
SCHEMA_ID = re.compile(r"onbox(ctl)?\.[a-z0-9_.]+/[0-9]+")
VOCAB = os.path.join("onbox", "vocab.py")
KEEPER = os.path.join("controller", "keeper") + os.sep
EMITS = ("emit", "_emit", "_say")  # the agent's: (type, **fields); the keeper's: (keep, kind, text, **fields)
# A field read whose value is a word of a vocabulary (its key: `doc.get(KEY)`, `doc[KEY]`, and for the last two
# `obj.KEY`), the words, and how a literal compared with it is reported. An event's type is `type` in events.jsonl,
# `kind` in the keeper's record and the tracker's events.
EXIT_WORDS = frozenset(vocab.EXIT_CLASSES)
STOP_WORDS = frozenset(vocab.STOP_OUTCOMES)
READS: Dict[str, Tuple[FrozenSet[str], str]] = {
    "type": (EVENT_WORDS, "compared as an event type"), "kind": (EVENT_WORDS, "compared as an event type"),
    "classification": (EXIT_WORDS, "compared as an exit's classification"),
    "outcome": (STOP_WORDS, "compared as onbox stop's outcome")}
ATTRIBUTE_READS = ("classification", "outcome")
# Files that may spell a word of the vocabulary, each with why.
ALLOWED: Dict[str, str] = {
    os.path.join("controller", "kaggle", "kernel_main.py"):
        "runs on Kaggle's own Python with the standard library only: it imports nothing of onbox",
    os.path.join("controller", "commands", "kaggle.py"):
        "NEXT is keyed by a Kaggle session's outcome, the words kernel_main.py (above) writes, not by a run state",
}
_IGNORED = (ast.Name, ast.Load, ast.Store, ast.arg, ast.keyword, ast.BinOp, ast.Subscript)  # nothing to judge
UNKNOWN_EVENT = "emitted, not in onbox/vocab.py's %s"
COMPARED_EVENT = READS["type"][1]


def _words(node: ast.AST) -> List[ast.Constant]:
    """The state words a node is, or holds as the elements of a literal tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in STATE_WORDS:
        return [node]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                and e.value in STATE_WORDS]
    return []


def _read_key(node: ast.AST, names: Dict[str, str]) -> str:
    """The key of READS that `node` reads (`x.get("type")`, `x["kind"]`, `r.outcome`, or a name bound from such a
    read), else ""."""
    if isinstance(node, ast.Name):
        return names.get(node.id, "")
    if isinstance(node, ast.Attribute):
        return node.attr if node.attr in ATTRIBUTE_READS else ""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        key = node.args[0] if node.args else None
    elif isinstance(node, ast.Subscript):
        key = node.slice
    else:
        return ""
    return key.value if isinstance(key, ast.Constant) and key.value in READS else ""


def _bound_names(target: ast.AST, value: ast.AST) -> List[Tuple[str, ast.AST]]:
    """(name, value) for each name an assignment binds (`a, b = x, y` pairs them)."""
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
            and len(target.elts) == len(value.elts):
        return [pair for t, v in zip(target.elts, value.elts) for pair in _bound_names(t, v)]
    return []


def _vocab_words(node: ast.AST, words: FrozenSet[str]) -> List[ast.Constant]:
    """The `words` a literal is or holds (a tuple, list or set's elements, a dict's keys)."""
    elts = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(
        node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [e for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in words]


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


@dataclasses.dataclass
class Scan:
    """One source's findings: (line, the string, how) of each spelling out of place; the event types it emits."""
    found: List[Tuple[int, str, str]]
    emitted: FrozenSet[str]
    named: FrozenSet[str]  # the vocab names it uses (`vocab.EV_STATE`)


def scan(source: str, where: str = "<source>") -> Scan:
    """Parse `source` and walk it once: the spellings of states, schema ids and event types out of place, and the
    event types emitted (module docstring)."""
    tree = ast.parse(source, where)
    keeper = where.startswith(KEEPER)
    table, table_name = (vocab.KEEPER_EVENTS, "KEEPER_EVENTS") if keeper else (vocab.EVENT_TYPES, "EVENT_TYPES")
    consts: Dict[str, ast.AST] = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                                  for t in n.targets if isinstance(t, ast.Name)}
    docs: Set[int] = set()
    found: Dict[int, Tuple[int, str, str]] = {}
    emitted: Set[str] = set()
    named: Set[str] = set()
    read_names: Dict[str, str] = {}  # a name bound from a read of READS: its key
    compares: List[ast.Compare] = []

    def add(nodes: List[ast.Constant], how: str) -> None:
        for c in nodes:
            found.setdefault(id(c), (c.lineno, c.value, how))

    def emits(arg: ast.AST, line: int) -> None:
        if isinstance(arg, ast.Name) and isinstance(consts.get(arg.id), ast.Constant):
            arg = consts[arg.id]  # a module's constant: its value
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            emitted.add(arg.value)
            if arg.value not in table:
                found.setdefault(id(arg), (line, arg.value, UNKNOWN_EVENT % table_name))
        elif not isinstance(arg, ast.Name) and not (isinstance(arg, ast.Attribute) and isinstance(
                arg.value, ast.Name) and arg.value.id == "vocab"):
            found.setdefault(id(arg), (line, ast.unparse(arg), "emitted as an expression: name it in onbox/vocab.py"))

    todo: List[ast.AST] = [tree]
    while todo:  # every node once, a node before its children (an ast.walk without its per-node generators)
        node = todo.pop()
        for field in node._fields:
            child = getattr(node, field, None)
            if type(child) is list:
                todo.extend(c for c in child if isinstance(c, ast.AST))
            elif isinstance(child, ast.AST):
                todo.append(child)
        kind = type(node)
        if kind in _IGNORED:
            continue
        if kind is ast.Constant:
            v = node.value
            if type(v) is str and v.startswith("onbox") and id(node) not in docs and SCHEMA_ID.fullmatch(v):
                add([node], "a schema id")
        elif kind is ast.Expr:
            if type(node.value) is ast.Constant:  # a string standing as a statement: a docstring
                docs.add(id(node.value))
        elif kind is ast.Attribute:
            if type(node.value) is ast.Name and node.value.id == "vocab":
                named.add(node.attr)
        elif kind is ast.Call:
            name, args = _call_name(node), node.args
            if not keeper and name in EMITS and args and not isinstance(args[0], (ast.Dict, ast.Starred)):
                emits(args[0], node.lineno)  # emit(TYPE, **fields)
            elif keeper and name in (*EMITS, "event") and len(args) >= 2:
                emits(args[1], node.lineno)  # emit(keep, KIND, text), keep.event(now, KIND, text)
            elif keeper and name == "say" and args and isinstance(args[0], ast.Dict):
                for k, v in zip(args[0].keys, args[0].values):  # say({"kind": KIND, ...}): keep's own output
                    if isinstance(k, ast.Constant) and k.value == "kind":
                        emits(v, node.lineno)
        elif kind is ast.Compare:
            compares.append(node)
            for operand in [node.left, *node.comparators]:
                add(_words(operand), "compared as a state")
        elif kind in (ast.Tuple, ast.List, ast.Set):
            words = _words(node)
            if len(words) >= 2:
                add(words, "in a set of states")
        elif kind is ast.Dict:
            keys = [w for k in node.keys if k is not None for w in _words(k)]
            if len(keys) >= 2:
                add(keys, "a key of a table of states")
        elif kind is ast.Assign:
            for target in node.targets:
                read_names.update((name, key) for name, v in _bound_names(target, node.value)
                                  for key in [_read_key(v, {})] if key)

    for node in compares:  # a read of an event's type (an exit's classification, ...) compared with a spelling
        operands = [node.left, *node.comparators]
        keys = [_read_key(o, read_names) for o in operands]
        for key in filter(None, keys):
            words, how = READS[key]
            for o, other in zip(operands, keys):
                literal = consts.get(o.id) if isinstance(o, ast.Name) else o  # a module's set or table of them
                if literal is not None and not other:
                    add(_vocab_words(literal, words), how)
    return Scan(sorted(found.values()), frozenset(emitted), frozenset(named))


def spellings(source: str, where: str = "<source>") -> List[Tuple[int, str, str]]:
    """(line, the string, how it is used) for each spelling of a state, a schema id or an event type out of place
    in `source`."""
    return scan(source, where).found


@functools.lru_cache(maxsize=None)
def _scan(rel: str) -> Scan:
    """A file of the repository, parsed and walked once for every test here."""
    with open(os.path.join(REPO_ROOT, rel), encoding="utf-8") as f:
        return scan(f.read(), rel)


def source_files() -> Iterator[str]:
    for top in ("onbox", "controller"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO_ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for fn in sorted(filenames):
                if fn.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, fn), REPO_ROOT)


def _checked() -> Iterator[Tuple[str, Scan]]:
    for rel in source_files():
        if rel != VOCAB and rel not in ALLOWED:
            yield rel, _scan(rel)


def test_the_vocabulary_is_spelled_only_in_onbox_vocab():
    bad = ["%s:%d: %r %s" % (rel, line, text, how) for rel, sc in _checked() for line, text, how in sc.found
           if not how.startswith("emitted")]
    assert not bad, ("spell these through onbox.vocab (import the name; a state word used as something else "
                     "gets a name where its own vocabulary lives):\n" + "\n".join(bad))


def test_every_event_emitted_is_in_the_vocabulary():
    bad = ["%s:%d: %r %s" % (rel, line, text, how) for rel, sc in _checked() for line, text, how in sc.found
           if how.startswith("emitted")]
    assert not bad, ("add these to onbox/vocab.py's EVENT_TYPES (the agent's) or KEEPER_EVENTS (the keeper's), "
                     "each with what it means:\n" + "\n".join(bad))


def test_every_event_of_the_vocabulary_is_emitted_somewhere():
    """A type no one writes is a dead word: emitted by its literal, or its vocab name used (an event built ahead
    of its emit)."""
    emitted, named = set(), set()
    for _, sc in _checked():
        emitted |= sc.emitted
        named |= sc.named
    named_values = {getattr(vocab, n) for n in named if n.startswith(("EV_", "KEPT_"))}
    dead = sorted((set(vocab.EVENT_TYPES) | set(vocab.KEEPER_EVENTS)) - emitted - named_values)
    assert dead == [], "no emitter writes these: remove them from onbox/vocab.py, or emit them"


def test_every_event_name_of_the_vocabulary_is_in_its_table():
    for name in dir(vocab):
        if name.startswith("EV_"):
            assert getattr(vocab, name) in vocab.EVENT_TYPES, name
        elif name.startswith("KEPT_"):
            assert getattr(vocab, name) in vocab.KEEPER_EVENTS, name
    assert all(len(e.means) > 10 for e in (*vocab.EVENT_TYPES.values(), *vocab.KEEPER_EVENTS.values()))


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


def test_the_checker_catches_an_event_emitted_that_the_vocabulary_lacks():
    planted = '''
from onbox import vocab
LATE = "beat_late"

def run(self, ctx, emit, fields, kind):
    self.journal.emit("state", old="starting", new="running")   # registered
    emit("checkpoint_commited", step=3)                          # a typo
    ctx.emit("made_up", **fields)
    self._say(LATE)                                              # a module constant: its value is checked
    emit("phase_" + kind)                                        # built: not checkable
    emit(vocab.EV_LEASE_TAKEN, epoch=2)                          # vocab's name
    emit(kind, **fields)                                         # a forwarder's
'''
    assert spellings(planted) == [
        (7, "checkpoint_commited", "emitted, not in onbox/vocab.py's EVENT_TYPES"),
        (8, "made_up", "emitted, not in onbox/vocab.py's EVENT_TYPES"),
        (9, "beat_late", "emitted, not in onbox/vocab.py's EVENT_TYPES"),
        (10, "'phase_' + kind", "emitted as an expression: name it in onbox/vocab.py")]
    sc = scan(planted)
    assert sc.emitted == {"state", "checkpoint_commited", "made_up", "beat_late"} and "EV_LEASE_TAKEN" in sc.named


def test_the_checker_knows_the_keepers_call_shapes():
    planted = '''
def advance(self, r, keep, now, text):
    self.emit(keep, "detected", text)                  # registered
    r.emit(keep, "gone_fishing", text)
    keep.event(now, "launched", text)                  # registered
    keep.event(now, "state", text)                     # an agent's type, not the keeper's
    self.say({"time": now, "kind": "record_problme", "text": text})
'''
    where = os.path.join("controller", "keeper", "planted.py")
    assert spellings(planted, where) == [
        (4, "gone_fishing", "emitted, not in onbox/vocab.py's KEEPER_EVENTS"),
        (6, "state", "emitted, not in onbox/vocab.py's KEEPER_EVENTS"),
        (7, "record_problme", "emitted, not in onbox/vocab.py's KEEPER_EVENTS")]
    assert spellings(planted) == []  # outside the keeper these are no emits of the shape the agent's are


def test_the_checker_catches_an_event_type_compared_outside_the_vocabulary():
    planted = '''
SUMMARY = {"sync_failed", "durable_full"}
GAVE_UP = {"failed_launch": "could not launch it"}

def on_event(ev, last):
    kind = ev.get("type")
    if kind == "checkpoint_committed" or kind in SUMMARY:
        pass
    t, at = ev["type"], ev.get("time")
    if t in ("exit", "adopted") or last.get("kind") in GAVE_UP or last["kind"] != "ended":
        pass
'''
    assert spellings(planted) == [
        (2, "durable_full", COMPARED_EVENT), (2, "sync_failed", COMPARED_EVENT), (3, "failed_launch", COMPARED_EVENT),
        (7, "checkpoint_committed", COMPARED_EVENT), (10, "adopted", COMPARED_EVENT), (10, "ended", COMPARED_EVENT),
        (10, "exit", COMPARED_EVENT)]


def test_the_checker_leaves_other_uses_of_event_words_alone():
    clean = '''
from onbox import vocab
PHASES = ("detected", "declared_lost", "pushed")   # a set of words never compared with an event's type
ROW = {"state": "running", "exit": 0}              # field names

def on_event(ev, cur, op, doc):
    kind = ev.get("type")
    if kind == vocab.EV_STATE or kind in (vocab.EV_ADOPTED, vocab.EV_PHASE_STARTED):
        log("state changed")                       # a message
    if op == "state" or "pushed" not in cur.phases or doc.get("type") == "number":
        pass
'''
    assert spellings(clean) == []


def test_the_checker_catches_a_classification_or_a_stop_outcome_compared_outside_the_vocabulary():
    planted = '''
def said(done, ex, result):
    c = ex.get("classification")
    if c == "signal" or result.classification in ("cuda_oom", "hung") or done.outcome == "already_ended":
        pass
    if ex["outcome"] != "asked" or c == vocab.EXIT_FENCED or done.outcome == vocab.STOP_ASKED:
        pass
    if d.outcome == "terminated by SIGTERM" or ex.get("signal") == "SIGKILL":   # words of no vocabulary here
        pass
'''
    exit_how, stop_how = READS["classification"][1], READS["outcome"][1]
    assert spellings(planted) == [
        (4, "already_ended", stop_how), (4, "cuda_oom", exit_how), (4, "hung", exit_how), (4, "signal", exit_how),
        (6, "asked", stop_how)]


def test_the_dashboards_keeper_kinds_are_the_keepers():
    """The dashboard (JavaScript, which cannot import vocab) marks the keeper's events by kind: each kind it names
    is one the keeper writes."""
    with open(os.path.join(REPO_ROOT, "controller", "tracker", "static", "dashboard.js"), encoding="utf-8") as f:
        js = f.read()
    def table(name: str) -> str:
        m = re.search(r"var %s = ([\[{].*?[\]}]);" % name, js, re.S)
        assert m, name
        return m.group(1)

    kinds = set(re.findall(r"([a-z_]+):", table("KEEPER_MARKS")))  # its keys
    kinds |= set(re.findall(r'"([a-z_]+)"', table("RECOVERY_KINDS")))
    assert len(kinds) >= 10 and kinds - set(vocab.KEEPER_EVENTS) == set()
