"""The size rules that keep each concept findable, checked on the code itself:

- no class over MAX_CLASS_CODE lines of code (docstrings, comments and blank lines not counted): a class past that
  does two things, and the second has a module of its own to go to;
- no module over MAX_MODULE_LINES lines unless its docstring says why ("Past 400 lines on purpose: ...").
"""
from __future__ import annotations

import ast
import io
import os
import tokenize
from typing import List, Tuple

from tests.conftest import REPO_ROOT

MAX_CLASS_CODE = 300
MAX_MODULE_LINES = 400
REASON = "Past 400 lines on purpose"
_SKIP = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
_STATEMENT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)


def code_lines(source: str, first: int, last: int) -> int:
    """Lines from `first` to `last` (1-based, inclusive) that hold code: not blank, not only a comment, not part of
    a string that stands alone as a statement (a docstring)."""
    lines = set()
    prev = None  # the previous token that is not a comment or a line break inside a statement
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        standalone = tok.type == tokenize.STRING and (prev is None or prev.type in _STATEMENT_START)
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok
        if tok.type in _SKIP or standalone:
            continue
        lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if first <= n <= last)
    return len(lines)


def _sources() -> List[str]:
    out = []
    for top in ("onbox", "controller"):
        for dirpath, _dirs, files in os.walk(os.path.join(REPO_ROOT, top)):
            out += [os.path.relpath(os.path.join(dirpath, f), REPO_ROOT) for f in files if f.endswith(".py")]
    return sorted(out)


def _classes() -> List[Tuple[str, str, int]]:
    out = []
    for rel in _sources():
        with open(os.path.join(REPO_ROOT, rel), encoding="utf-8") as f:
            source = f.read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                end = node.end_lineno or node.lineno
                out.append((rel, node.name, code_lines(source, node.lineno, end)))
    return out


def test_code_lines_counts_code_only():
    source = ('class A:\n'
              '    """A docstring\n'
              '    over two lines."""\n'
              '\n'
              '    # a comment\n'
              '    x = ("a string in code",\n'
              '         2)  # and a comment after code\n'
              '\n'
              '    def f(self):\n'
              '        """Its docstring."""\n'
              '        return 1\n')
    assert code_lines(source, 1, 11) == 5  # class A:, the two lines of x, def f, return 1
    assert code_lines(source, 9, 11) == 2


def test_the_sizes_are_read_from_the_real_code():
    classes = {(rel, name): n for rel, name, n in _classes()}
    assert len(classes) > 100 and classes[("onbox/supervisor/loop.py", "Supervisor")] > 150


def test_no_class_is_over_the_limit():
    over = ["%s: %s has %d lines of code" % (rel, name, n) for rel, name, n in _classes() if n > MAX_CLASS_CODE]
    assert not over, ("over %d lines of code, a class does two things: move the second into a module of its own\n%s"
                      % (MAX_CLASS_CODE, "\n".join(over)))


def test_a_long_module_says_why():
    unexplained = []
    for rel in _sources():
        with open(os.path.join(REPO_ROOT, rel), encoding="utf-8") as f:
            source = f.read()
        if source.count("\n") > MAX_MODULE_LINES and REASON not in (ast.get_docstring(ast.parse(source)) or ""):
            unexplained.append("%s: %d lines" % (rel, source.count("\n")))
    assert not unexplained, ("split these, or say in the docstring why each is one module (%r ...):\n%s"
                             % (REASON, "\n".join(unexplained)))
