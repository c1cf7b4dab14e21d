"""What `onbox --version`, `--help` and `status --json` import: every `onboxctl` call over ssh and every `onbox status`
pays its start-up, so these commands import only what they use (issue 23; the time itself is `python -m tests.bench
zipapp`'s figure, beside `import click`). Each command runs in a fresh interpreter, which then lists sys.modules."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.supervisor_helpers import env_for, onbox

pytestmark = pytest.mark.integration

# Runs the CLI, then writes sys.modules as it stood before json (the writer's own) was imported.
DRIVER = """\
import sys
out, args = sys.argv[1], sys.argv[2:]
from onbox.cli import main
try:
    main(args)
except SystemExit:
    pass
loaded = sorted(sys.modules)
import json
with open(out, "w") as f:
    json.dump(loaded, f)
"""
CLI = {"onbox", "onbox.cli", "onbox.commands", "onbox.clikit", "onbox.errors"}
# What reading run directories needs: the state (its words from the vocabulary, a leaf), the pid + start time check,
# the run's lock.
STATUS = CLI | {"onbox.commands.runs", "onbox.paths", "onbox.environment", "onbox.fsutil", "onbox.untrusted",
                "onbox.proc", "onbox.clock", "onbox.supervisor", "onbox.supervisor.detach", "onbox.supervisor.rundir",
                "onbox.supervisor.state", "onbox.vocab"}
# Heavy or never needed to print a version, help or a status (click's help formatter imports shutil itself).
NEVER = {"subprocess", "tempfile", "socket", "requests", "psutil", "urllib3", "pynvml", "tomllib", "tomli"}
CASES = [
    (["--version"], CLI, NEVER | {"json", "shutil", "dataclasses"}),
    (["--help"], CLI, NEVER | {"json", "dataclasses"}),
    (["status", "--json"], STATUS, NEVER | {"shutil"}),
]


@pytest.fixture(scope="module")
def home_with_a_run(tmp_path_factory):
    """An ONBOX_HOME holding one finished run, so that `status --json` reads a real run directory."""
    home = tmp_path_factory.mktemp("onbox-home")
    r = onbox(home, "run", "--foreground", "--name", "done-run", "--restart", "never", "--", "true")
    assert r.returncode == 0, r.stderr
    return home


@pytest.mark.parametrize("args,allowed,never", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_command_imports_only_what_it_uses(args, allowed, never, home_with_a_run, tmp_path):
    out = tmp_path / "modules.json"
    r = subprocess.run([sys.executable, "-c", DRIVER, str(out), *args], env=env_for(home_with_a_run),
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    if args[0] == "status":
        assert [run["run"] for run in json.loads(r.stdout)] == ["done-run"]
    loaded = set(json.loads(out.read_text()))
    ours = {m for m in loaded if m == "onbox" or m.startswith(("onbox.", "controller"))}
    assert ours <= allowed, "imported beyond what %s needs: %s" % (" ".join(args), sorted(ours - allowed))
    assert not loaded & never, "%s imported %s" % (" ".join(args), sorted(loaded & never))
