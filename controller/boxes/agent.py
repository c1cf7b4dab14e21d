"""Asking a box's agent: `python3 .onbox/onbox.pyz ARGS --json` over ssh, and nothing else (no script sent).

The documents are versioned (`schema`) and documented in onbox/commands/README.md, "What onboxctl reads". An answer without the
document is the agent's refusal (exit 2: no such run, a bad name; said in its words) or a failure (an onbox.pyz
older than this onboxctl, a crash): both say what came back and how to get the onbox this onboxctl speaks to.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from controller.boxes.inventory import Box
from controller.boxes.ssh import Result, Ssh
from onbox import untrusted
from onbox.errors import JobFailed, OnboxError, UsageError

# where things live on a box, relative to the login directory (the box's own python runs the pyz)
REMOTE_ROOT = ".onbox"
REMOTE_PYZ = REMOTE_ROOT + "/onbox.pyz"
REMOTE_CODE = REMOTE_ROOT + "/code"
REMOTE_PUSHED = REMOTE_ROOT + "/pushed.json"
REMOTE_SECRETS = REMOTE_ROOT + "/secrets"


def parse_json_any(text: str) -> Any:
    """The JSON document (object or list) a command printed, even if a stray line came before it; None if none."""
    text = text.strip()
    for start in [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]:
        chunk = text[start:]
        if chunk.startswith(("{", "[")):
            try:  # a box's answer is untrusted: nested 100,000 deep it is no document, never a RecursionError
                return untrusted.loads_json(chunk, "the box's answer")
            except ValueError:
                continue
    return None


def ask(ssh: Ssh, box: Box, args: List[str], timeout: float = 60.0) -> Tuple[Any, Result, str]:
    """(the JSON document `onbox ARGS` printed or None, the result, what was asked in words). Never raises for
    the command's own exit code: a run list comes with exit 2 when one run's state.json is corrupt."""
    what = "onbox %s" % " ".join(a for a in args if a != "--json")
    res = ssh.run(box.target(), [box.python, REMOTE_PYZ, *args], timeout=timeout, check=False, what=what)
    return parse_json_any(res.text), res, what


def refusal(box: Box, what: str, res: Result, wanted: str) -> OnboxError:
    """The error for an answer without the `wanted` document: the agent's own `onbox: ...` line when it said one."""
    said = [ln.strip() for ln in (res.err_text or res.text).splitlines() if ln.strip()]
    line = next((ln for ln in said if ln.startswith("onbox: ")), said[-1] if said else "(no output)")
    line = line[len("onbox: "):] if line.startswith("onbox: ") else line[-300:]
    push = "`onboxctl push %s`" % box.name
    if res.returncode == 2:
        return UsageError("%s on %s: %s" % (what, box.name, line),
                          hint="`onboxctl status --box %s` lists its runs; no onbox.pyz there, or one older than "
                               "this onboxctl: %s" % (box.name, push))
    return JobFailed("%s on %s %s" % (what, box.name, "exited %d: %s" % (res.returncode, line) if res.returncode
                                      else "printed no %s document" % wanted),
                     hint="push the onbox.pyz this onboxctl speaks to: %s" % push)


def agent_json(ssh: Ssh, box: Box, args: List[str], schema: str, timeout: float = 60.0) -> Dict[str, Any]:
    """The `schema` document `onbox ARGS` prints on the box (exit 0), else the refusal as an OnboxError."""
    doc, res, what = ask(ssh, box, args, timeout)
    if res.returncode == 0 and isinstance(doc, dict) and doc.get("schema") == schema:
        return doc
    raise refusal(box, what, res, schema)
