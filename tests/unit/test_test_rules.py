"""Rules the tests themselves keep, checked on their source (a rule broken only shows on some machines).

A test that interrupts a child with SIGINT must give that child the default disposition (`preexec_fn=
tests.conftest.default_sigint`): an ignored SIGINT survives exec, and a runner started in the background (CI,
`nohup`, `trap '' INT`, a shell's `cmd &`) passes it ignored to every child, so the interrupt would do nothing and
the test fails only there. The child is found by the name the SIGINT is sent to: `X.send_signal(signal.SIGINT)`,
`os.killpg(X.pid, signal.SIGINT)` or `os.kill(X.pid, signal.SIGINT)`; X's Popen call must carry the preexec_fn.
"""
from __future__ import annotations

import ast
import os
from typing import List, Optional, Tuple

from tests.conftest import REPO_ROOT

TESTS = os.path.join(REPO_ROOT, "tests")


def _is_sigint(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "SIGINT"


def _target(call: ast.Call) -> Optional[str]:
    """The name of the process a SIGINT is sent to by `call`, or None when it sends none."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "send_signal" and call.args and _is_sigint(call.args[0]):
        return ast.unparse(f.value)
    if isinstance(f, ast.Attribute) and f.attr in ("killpg", "kill") and len(call.args) == 2 and \
            _is_sigint(call.args[1]):
        pid = call.args[0]
        return ast.unparse(pid.value) if isinstance(pid, ast.Attribute) and pid.attr == "pid" else ast.unparse(pid)
    return None


def _started_with_default_sigint(scope: ast.AST, name: str, before: int) -> bool:
    """Whether the last call assigned to `name` in `scope` before line `before` passes preexec_fn=default_sigint."""
    assigned = [node for node in ast.walk(scope) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and node.lineno < before and any(ast.unparse(t) == name for t in node.targets)]
    if not assigned:
        return False
    last = max(assigned, key=lambda node: node.lineno)
    kw = {k.arg: ast.unparse(k.value) for k in last.value.keywords if k.arg}
    return kw.get("preexec_fn", "").endswith("default_sigint")


def _checks(tree: ast.AST) -> List[Tuple[int, str, bool]]:
    """(line, the process, whether it was started with the default SIGINT) for each SIGINT sent in `tree`, judged in
    the function that sends it."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                who = _target(node)
                if who is not None:
                    out.append((node.lineno, who, _started_with_default_sigint(fn, who, node.lineno)))
    return out


def test_every_child_a_test_interrupts_has_the_default_sigint():
    problems: List[str] = []
    checked = 0
    for dirpath, _dirs, files in os.walk(TESTS):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for line, who, ok in dict(((ln, w), (ln, w, o)) for ln, w, o in _checks(tree)).values():
                checked += 1
                if not ok:
                    problems.append("%s:%d: SIGINT to %s, started without preexec_fn=default_sigint"
                                    % (os.path.relpath(path, REPO_ROOT), line, who))
    assert checked >= 3  # the rule has something to check: the suite interrupts children this way
    assert not problems, "\n".join(problems)


def test_the_rule_catches_a_child_started_without_it():
    bad = ast.parse("def t():\n    p = subprocess.Popen(argv)\n    p.send_signal(signal.SIGINT)\n")
    good = ast.parse("def t():\n    p = subprocess.Popen(argv, preexec_fn=default_sigint)\n"
                     "    os.killpg(p.pid, signal.SIGINT)\n")
    later = ast.parse("def t():\n    p = subprocess.Popen(argv)\n    p.wait()\n"
                      "    p = subprocess.Popen(argv, preexec_fn=default_sigint)\n    os.kill(p.pid, signal.SIGINT)\n")
    assert [ok for _l, _w, ok in _checks(bad)] == [False]
    assert [ok for _l, _w, ok in _checks(good)] == [True]
    assert [ok for _l, _w, ok in _checks(later)] == [True]
