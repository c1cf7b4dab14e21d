"""README.md is the front door: short (at most 380 lines), every relative link and repository path it names exists,
its map names every package README, its journey is the one tests/integration/test_journey.py runs (the same
`onboxctl` commands and run flags, with `python3`), and the file names it says never count as a checkpoint are the
ones onbox ignores. The package READMEs' own links must exist too."""
from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from typing import List

from onbox.checkpoints import formats
from onbox.checkpoints.local import detect
from tests.conftest import REPO_ROOT

MAX_LINES = 380
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
# the repository's top-level directories a README names as paths (build/out/ is what the make targets create)
TOP = ("onbox/", "controller/", "build/", "tests/", "profiles/")


def _read(rel: str) -> str:
    with open(os.path.join(REPO_ROOT, rel), encoding="utf-8") as f:
        return f.read()


def missing_paths(text: str, base: str) -> List[str]:
    """Relative links (resolved from `base`, the README's dir) and backticked repository paths (from the root) in
    `text` that do not exist."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if not os.path.exists(os.path.join(REPO_ROOT, base, path)):
            out.append(target)
    for token in CODE.findall(text):
        token = token.rstrip(".,;:")
        if not token.startswith(TOP) or token.startswith("build/out/") or re.search(r"[<>{}$*]", token):
            continue
        if not os.path.exists(os.path.join(REPO_ROOT, token)):
            out.append(token)
    return out


def package_readmes() -> List[str]:
    """Every README.md of the repository but the top-level one (git's files, and new ones not yet added)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", "*README.md"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return sorted(n for n in set(names) if n != "README.md" and os.path.exists(os.path.join(REPO_ROOT, n)))


def section(text: str, heading: str) -> str:
    """The text of the `## ` section whose heading starts with `heading`."""
    m = re.search(r"^## %s.*?$(.*?)(?=^## |\Z)" % re.escape(heading), text, re.M | re.S)
    assert m, "README.md has no section %r" % heading
    return m.group(1)


def test_the_readme_is_short():
    lines = _read("README.md").count("\n")
    assert lines <= MAX_LINES, "README.md has %d lines (at most %d): move reference to a package README" % (
        lines, MAX_LINES)


def test_every_path_the_readme_names_exists():
    assert missing_paths(_read("README.md"), "") == []


def test_every_package_readme_link_exists():
    bad = {}
    for name in package_readmes():
        text = _read(name)
        links = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
        gone = [t for t in links if not os.path.exists(os.path.join(REPO_ROOT, os.path.dirname(name),
                                                                    t.split("#")[0]))]
        if gone:
            bad[name] = gone
    assert bad == {}


def test_the_path_check_finds_what_is_missing_and_only_that():
    text = ("see [the keeper](controller/keeper/README.md), [gone](controller/nowhere/README.md), "
            "[web](https://example.org/x), `build/sysdeps.sh`, `onbox/no_such_module.py`, `build/out/mlflow-venv/`, "
            "`onbox/checkpoints/README.md`, `$ONBOX_HOME/runs/<run>/`, `tests/integration/test_journey.py`.")
    assert missing_paths(text, "") == ["controller/nowhere/README.md", "onbox/no_such_module.py"]
    # relative to the README's own dir
    assert missing_paths("[API](API.md)", "controller/tracker") == []
    assert missing_paths("[API](API.md)", "controller") == ["API.md"]


def test_the_map_names_every_package_readme():
    the_map = section(_read("README.md"), "Where the rest is")
    linked = set(LINK.findall(the_map))
    readmes = package_readmes()
    assert len(readmes) >= 15, readmes  # the package READMEs exist: a listing that found none proves nothing
    assert [n for n in readmes if n not in linked] == []


def test_the_journey_is_the_one_the_test_runs():
    block = re.search(r"```\n(.*?)```", section(_read("README.md"), "The journey"), re.S)
    assert block
    lines = [x for x in block.group(1).splitlines() if x.startswith(("onboxctl", "    --"))]
    commands = [x.split("#")[0].split() for x in lines if x.startswith("onboxctl")]
    test = _read("tests/integration/test_journey.py")
    subcommands = {c[1] for c in commands}
    assert subcommands == {"box", "push", "tracker", "secrets", "run", "status", "stop", "pull", "down"}, subcommands
    for c in commands:  # each command of the journey is one the test runs: ctl("push", "gpu1", ...), ["run", ...]
        words = c[1:3] if len(c) > 2 and not c[2].startswith("-") else c[1:2]
        said = ", ".join('"%s"' % w for w in words)
        assert said in test, "the journey test does not run onboxctl %s" % " ".join(words)
    run = " ".join(x.split("#")[0] for x in lines if x.startswith("onboxctl run") or x.startswith("    --"))
    for flag in re.findall(r"(--[a-z-]+)", run):
        assert '"%s"' % flag in test, "the README's run line has %s, the journey test's does not" % flag
    assert "-- python3 train.py" in run, run  # python3: what a stock Debian box has
    assert not re.search(r"\bpython\b(?!3)", block.group(1)), "the journey says `python`: a stock Debian box " \
                                                               "has only python3"


def test_the_names_the_readme_says_never_count_are_the_ones_onbox_ignores():
    text = section(_read("README.md"), "What your trainer must do")
    rule = text[text.index("**Which files count"):text.index("A candidate is committed")]
    globs = [g for g in CODE.findall(rule) if "*" in g or g.startswith(".")]
    assert len(globs) >= 15, globs
    for g in globs:
        name = (g[:-1] if g.endswith("*") else g).replace("*", "a1")  # a name the glob matches
        assert (formats.in_progress(name) or any(fnmatch.fnmatch(name, p) for p in detect.DEFAULT_IGNORE)
                or name.endswith(detect.SIDE_MARKERS)), "README.md says %s never counts; onbox would take %s" % (
                    g, name)
