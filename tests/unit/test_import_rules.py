"""The import rules that keep the layout readable, checked on the code's own imports (every `import` statement,
inside functions and TYPE_CHECKING blocks too):

- onbox never imports controller (the agent ships alone in onbox.pyz);
- library code never imports onbox.commands or click (only onbox/cli.py, onbox/clikit.py and onbox/commands/ are CLI);
- the controller has rooms (boxes, launch, results, tracker, keeper, kaggle, goodput, commands) with contracts too;
- no import circles, between modules or between packages;
- each package imports only what its contract below allows (the same lists as the package docstrings).
"""
from __future__ import annotations

import ast
import functools
import os
from typing import Dict, List, Set

import pytest

from tests.conftest import REPO_ROOT

# What each part of onbox may import (besides itself). A top-level module counts as its own part.
LEAVES = {"onbox", "onbox.errors", "onbox.clock", "onbox.paths", "onbox.fsutil", "onbox.proc", "onbox.tomlread",
          "onbox.environment",
          "onbox.untrusted", "onbox.toolrun", "onbox.vocab"}
CONTRACT: Dict[str, Set[str]] = {
    "onbox.errors": set(),
    "onbox.vocab": set(),  # the run's vocabulary (alert kinds and severities): every part may import it
    "onbox.clock": set(),
    "onbox.environment": set(),
    "onbox.paths": {"onbox.environment"},
    "onbox.proc": {"onbox.clock"},  # the escalation's deadlines run on the clock seam
    # every tool call: its failures become the caller's domain error; a Helper (rclone rcd) is stopped by its PID
    # and start time through the one process seam
    "onbox.toolrun": {"onbox.errors", "onbox.proc"},
    "onbox.untrusted": set(),
    "onbox.fsutil": {"onbox.untrusted"},  # every JSON state file and token file is read through untrusted
    "onbox.tomlread": {"onbox.errors", "onbox.untrusted"},
    "onbox.telemetry": {"onbox.errors", "onbox.vocab"},
    "onbox.config": {"onbox.errors", "onbox.paths", "onbox.tomlread", "onbox.telemetry", "onbox.untrusted"},
    "onbox.checkpoints": LEAVES,
    "onbox.gpu": LEAVES,
    "onbox.platform": LEAVES | {"onbox.config", "onbox.telemetry", "onbox.gpu"},
    "onbox.multinode": LEAVES | {"onbox.config", "onbox.checkpoints"},
    "onbox.slurm": LEAVES | {"onbox.config", "onbox.platform", "onbox.multinode"},
    "onbox.supervisor": LEAVES | {"onbox.config", "onbox.telemetry", "onbox.slurm"},
    "onbox.heartbeat": LEAVES | {"onbox.config", "onbox.telemetry", "onbox.gpu", "onbox.slurm", "onbox.supervisor",
                                 "onbox.multinode"},
    "onbox.subsystems": LEAVES | {"onbox.config", "onbox.checkpoints", "onbox.heartbeat", "onbox.gpu",
                                  "onbox.slurm", "onbox.supervisor", "onbox.multinode"},
    "onbox.queue": LEAVES | {"onbox.config", "onbox.supervisor", "onbox.gpu"},
    # a launch wires the supervisor and the subsystems together, as the commands did: only they import it
    "onbox.launch": LEAVES | {"onbox.config", "onbox.supervisor", "onbox.subsystems", "onbox.platform",
                              "onbox.multinode", "onbox.slurm"},
    "onbox.examples": set(),
    "onbox.templates": LEAVES,  # its data files (the templates) import nothing of onbox
}
CLI_PARTS = {"onbox.cli", "onbox.__main__", "onbox.commands", "onbox.clikit"}


def module_files() -> Dict[str, str]:
    """Every module of onbox and controller: dotted name -> path."""
    out = {}
    for top in ("onbox", "controller"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO_ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for fn in filenames:
                if fn.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, fn), REPO_ROOT)[:-3].replace(os.sep, ".")
                    out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, fn)
    return out


def imports_of(path: str, module: str, known: Set[str]) -> Set[str]:
    """The modules a file imports (resolved to a known module where `from X import name` names a submodule)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = "%s.%s" % (base, a.name)
                out.add(full if full in known else base)
    return out


@functools.lru_cache(maxsize=1)
def graph() -> Dict[str, Set[str]]:
    files = module_files()
    known = set(files)
    return {m: imports_of(p, m, known) for m, p in files.items()}


def part_of(module: str) -> str:
    """onbox.gpu.reaper -> onbox.gpu; onbox.config -> onbox.config; controller.x -> controller."""
    parts = module.split(".")
    if parts[0] == "controller":
        return "controller"
    return ".".join(parts[:2])


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted: the import circles."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def internal(g: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    return {m: {t for t in ts if t in g and t != m} for m, ts in g.items()}


def part_graph(g: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    out: Dict[str, Set[str]] = {}
    for m, ts in internal(g).items():
        a = part_of(m)
        out.setdefault(a, set()).update(part_of(t) for t in ts if part_of(t) != a)
    return out


# Inside onbox.checkpoints: each folder (and each top-level module) over the base layer (the package's own
# __init__: names and errors). A part may import only what stands below it here; the package docstrings say the same.
CKPT = "onbox.checkpoints"
CHECKPOINT_LAYERS: Dict[str, Set[str]] = {
    CKPT: set(),
    CKPT + ".durable": {CKPT},  # targets, manifest, index, hashcopy, retention, the commit lock
    CKPT + ".formats": {CKPT},  # one module per format, in a registry
    CKPT + ".leases": {CKPT, CKPT + ".durable"},
    CKPT + ".local": {CKPT, CKPT + ".durable", CKPT + ".formats"},  # the box's checkpoint dir
    CKPT + ".commit": {CKPT, CKPT + ".durable", CKPT + ".formats", CKPT + ".local"},
    CKPT + ".verify": {CKPT, CKPT + ".durable", CKPT + ".formats", CKPT + ".local"},
    CKPT + ".recheck": {CKPT, CKPT + ".durable", CKPT + ".leases"},
    CKPT + ".hook": {CKPT, CKPT + ".durable", CKPT + ".formats", CKPT + ".leases", CKPT + ".local",
                     CKPT + ".commit"},
    CKPT + ".runfacts": {CKPT, CKPT + ".durable", CKPT + ".leases", CKPT + ".commit"},
    CKPT + ".listing": {CKPT, CKPT + ".durable", CKPT + ".formats", CKPT + ".local", CKPT + ".hook"},
}


def checkpoint_part(module: str) -> str:
    """onbox.checkpoints.durable.rclone -> onbox.checkpoints.durable; onbox.checkpoints -> onbox.checkpoints."""
    return ".".join(module.split(".")[:3])


def checkpoint_part_graph(g: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    out: Dict[str, Set[str]] = {}
    for m, ts in internal(g).items():
        if m != CKPT and not m.startswith(CKPT + "."):
            continue
        a = checkpoint_part(m)
        out.setdefault(a, set()).update(checkpoint_part(t) for t in ts if (t == CKPT or t.startswith(CKPT + "."))
                                        and checkpoint_part(t) != a)
    return out


def test_the_checker_finds_a_circle_and_a_clean_graph_has_none():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    here = imports_of(__file__, "tests.unit.test_import_rules", {"tests.conftest"})
    assert {"ast", "os", "pytest", "tests.conftest"} <= here  # the reader sees this very file's imports


def test_onbox_never_imports_controller():
    bad = sorted("%s imports %s" % (m, t) for m, ts in graph().items() if m.startswith("onbox")
                 for t in ts if t.split(".")[0] == "controller")
    assert bad == []


def test_library_code_never_imports_the_cli():
    bad = sorted("%s imports %s" % (m, t) for m, ts in graph().items()
                 if m.startswith("onbox") and part_of(m) not in CLI_PARTS
                 for t in ts if t == "click" or t.startswith("click.") or part_of(t) == "onbox.commands")
    assert bad == []


def test_no_circles_between_modules():
    assert cycles(internal(graph())) == []


def test_no_circles_between_packages():
    assert cycles(part_graph(graph())) == []


@pytest.mark.parametrize("part", sorted(CONTRACT))
def test_each_package_imports_only_what_its_contract_allows(part):
    actual = part_graph(graph()).get(part, set())
    assert actual - CONTRACT[part] - {part} == set(), "widen CONTRACT (and the package docstring) on purpose"


def test_every_part_of_onbox_has_a_contract():
    parts = {part_of(m) for m in module_files() if m.startswith("onbox.")}
    assert parts - set(CONTRACT) - CLI_PARTS == set()


def test_the_extraction_root_imports_nothing_of_onbox():
    # build/zipapp.py embeds its source in the pyz's __main__.py, before onbox is importable
    assert {t for t in graph()["onbox.platform.extractroot"] if t.split(".")[0] == "onbox"} == set()


def _subpackages():
    """Every package below onbox/ and controller/ that holds modules of its own (the templates are user code and the
    top-level packages are described in onbox/README.md's layout)."""
    out = []
    for top in ("onbox", "controller"):
        for dirpath, _dirs, files in os.walk(os.path.join(REPO_ROOT, top)):
            rel = os.path.relpath(dirpath, REPO_ROOT)
            if dirpath == os.path.join(REPO_ROOT, top) or "__init__.py" not in files or "templates" in rel:
                continue
            modules = sorted(f for f in files if f.endswith(".py") and f != "__init__.py")
            if modules:
                out.append((rel, modules))
    return out


@pytest.mark.parametrize("package,modules", _subpackages(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_package_docstring_names_every_module_of_the_package(package, modules):
    import ast

    with open(os.path.join(REPO_ROOT, package, "__init__.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    missing = [m for m in modules if m not in doc]
    assert not missing, "%s/__init__.py's docstring says nothing of %s: a newcomer reads it first" % (
        package, ", ".join(missing))


def test_every_part_of_the_checkpoints_package_has_a_layer():
    assert set(checkpoint_part_graph(graph())) - set(CHECKPOINT_LAYERS) == set()


@pytest.mark.parametrize("part", sorted(CHECKPOINT_LAYERS))
def test_each_part_of_the_checkpoints_package_imports_only_what_stands_below_it(part):
    actual = checkpoint_part_graph(graph()).get(part, set())
    assert actual - CHECKPOINT_LAYERS[part] == set(), "widen CHECKPOINT_LAYERS (and the package docstring) on purpose"


def test_the_checkpoint_layers_have_no_circle():
    assert cycles(CHECKPOINT_LAYERS) == []


# The controller's rooms, each over the rooms it may import (besides onbox's library): the same lists as their
# package docstrings. boxes is the floor (inventory, ssh, the agent's questions, tunnels); launch and results stand on
# it; the tracker reads pull records and prices; the keeper uses all of those; commands and the CLI sit on top.
CONTROLLER_CONTRACT: Dict[str, Set[str]] = {
    "controller": set(),
    "controller.goodput": set(),  # pure: beats in, ledgers out (prices read from a file)
    "controller.boxes": {"controller.goodput"},  # a box's price
    "controller.userconfig": {"controller.boxes"},
    "controller.launch": {"controller.boxes", "controller.userconfig"},  # the tracker URL's rule
    "controller.results": {"controller.boxes"},
    "controller.tracker": {"controller.boxes", "controller.goodput", "controller.results"},
    "controller.kaggle": {"controller.launch", "controller.results"},
    "controller.keeper": {"controller.boxes", "controller.goodput", "controller.launch", "controller.tracker"},
    "controller.commands": {"controller.boxes", "controller.goodput", "controller.kaggle", "controller.keeper",
                            "controller.launch", "controller.results", "controller.tracker", "controller.userconfig"},
    "controller.cli": {"controller.commands"},
    "controller.__main__": {"controller.cli"},
}
# onbox's CLI parts a controller module may import: the kit both CLIs share (onbox/clikit.py) in the controller's own
# CLI; the agent's `onbox run` parser where a Kaggle push checks a session's options with it.
CONTROLLER_CLI = {"controller.cli", "controller.commands"}
ONBOX_CLI_USERS = {"controller.kaggle.onboxargs": {"onbox.commands"}}


def controller_part(module: str) -> str:
    """controller.boxes.ssh -> controller.boxes; controller.cli -> controller.cli; onbox.x.y -> onbox.x."""
    return ".".join(module.split(".")[:2])


def controller_part_graph(g: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    out: Dict[str, Set[str]] = {}
    for m, ts in internal(g).items():
        if m.split(".")[0] != "controller":
            continue
        a = controller_part(m)
        out.setdefault(a, set()).update(controller_part(t) for t in ts
                                        if t.split(".")[0] == "controller" and controller_part(t) != a)
    return out


def test_every_room_of_the_controller_has_a_contract():
    assert set(controller_part_graph(graph())) - set(CONTROLLER_CONTRACT) == set()


@pytest.mark.parametrize("part", sorted(CONTROLLER_CONTRACT))
def test_each_room_of_the_controller_imports_only_what_its_contract_allows(part):
    actual = controller_part_graph(graph()).get(part, set())
    assert actual - CONTROLLER_CONTRACT[part] == set(), "widen CONTROLLER_CONTRACT (and the docstring) on purpose"


def test_the_controller_contract_has_no_circle_and_nothing_runs_back_up():
    assert cycles(CONTROLLER_CONTRACT) == []
    assert cycles(controller_part_graph(graph())) == []


def test_only_the_controllers_cli_imports_onboxs_cli_parts():
    bad = sorted("%s imports %s" % (m, t) for m, ts in graph().items() if m.split(".")[0] == "controller"
                 and controller_part(m) not in CONTROLLER_CLI
                 for t in ts if (t == "onbox.clikit" or t == "click" or part_of(t) in CLI_PARTS)
                 and part_of(t) not in ONBOX_CLI_USERS.get(m, set()) and not (t == "click" and m in ONBOX_CLI_USERS))
    assert bad == []


def test_the_controller_checker_sees_a_room_that_imports_upward():
    fake = {"controller.boxes.ssh": {"controller.keeper.loop"}, "controller.keeper.loop": {"controller.boxes.ssh"}}
    assert controller_part_graph(fake) == {"controller.boxes": {"controller.keeper"},
                                           "controller.keeper": {"controller.boxes"}}
    assert "controller.keeper" not in CONTROLLER_CONTRACT["controller.boxes"]
