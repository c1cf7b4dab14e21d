"""The README's journey ("The journey, from your laptop"), command by command, against a box with an address of its
own (a network namespace with its own sshd, which cannot reach this machine's 127.0.0.1, as a rented box cannot),
with the tracker on this machine: add a never-seen box, push the code, the token, the tracker, the secret, run,
status; then what the first hour brings: a 60 s link cut healed without a command typed, a preemption, and the same
`onboxctl run` line again resuming its run; then stop, pull and down. Each step's time is printed.

The trainer is the plain JSON trainer (tests/frameworks/json_rename.py: its state saved by rename every 20 steps),
saving its state as `step_<step>.txt`, a name onbox ignores by default: while nothing can be committed,
`onboxctl status` (a WARN line under the run, DURABLE CKPT `none`) and the dashboard (in a real browser: the run
list's alert count and cells, the run page's "Open alerts") say what is in the checkpoint dir and why none of it
counts, with the fix; `stop --wait`, `pull` and `down` say why nothing was committed. The fix it names
(`--ckpt-pattern '*.txt'`, through `--onbox-arg`) on the same run line: then the saves are committed, and every
screen says so (issue 32, item 5).

Deviations from the README's lines, each because the box is a test box: its port and key (`--port`, `--identity`),
its python (the inventory's `--python`, and the same path in the run's command), a free tracker port, and a durable
dir under the box's own /root (the namespace shares this machine's other directories).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional

import pytest

from tests.conftest import REPO_ROOT, subprocess_env
from tests.hosts.sshd_box import close_masters, free_port, stop_tunnel_supervisors
from tests.integration.test_dashboard_browser import browser  # noqa: F401 (the Playwright rig's fixture)
from tests.polling import wait_for
from tests.processes import Started, kill_exact

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow,
              pytest.mark.timeout(480)]  # a 60 s cut, a browser, two relaunches: past the suite's 120 s

CUT_S = 60.0
TRAIN = """import os, runpy, sys
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.argv = [os.path.join(here, "json_rename.py"), "--steps", "100000", "--sleep", "0.05", "--save-every", "20",
            "--name", "step_%06d.txt"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
RESUMED = re.compile(r"onbox-test: resumed at step (\d+) from ")  # json_rename.py's line (tests/frameworks/seam.py)


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def dashboard_login(page, url: str, token: str) -> None:
    page.goto(url + "/")
    page.fill("#token", token)
    page.click("#login")
    wait_for(lambda: page.url == url + "/", 10, "the run list after the login")


def list_cells(page, run: str) -> Optional[List[str]]:
    """The run's row in the dashboard's run list, its cells' text (None while it is not listed)."""
    return page.evaluate("r => { const tr = document.querySelector('#runs tr[data-run=\"' + r + '\"]');"
                         " return tr ? Array.from(tr.cells).map(c => c.textContent) : null; }", run)


def test_the_readme_journey_on_a_box_of_its_own(netns_box, tmp_path, onbox_pyz, request):
    e = netns_box.inventory_entry()
    py = e["python"]
    cm = tempfile.mkdtemp(prefix="oj", dir="/tmp")
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm,
                          "ONBOX_PYZ": onbox_pyz, "ONBOX_SSH_CONNECT_TIMEOUT": "5"})
    env.pop("ONBOX_TRACKER", None)
    env.pop("ONBOX_TRACKER_TOKEN", None)
    code = tmp_path / "code"
    code.mkdir()
    for name in ("json_rename.py", "seam.py"):  # the plain JSON trainer and its test seam (stdlib only)
        shutil.copy(os.path.join(REPO_ROOT, "tests", "frameworks", name), str(code / name))
    (code / "train.py").write_text(TRAIN)
    token = str(tmp_path / "onbox-token")
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # (umask 077; openssl rand -hex 32 > ...)
    os.write(fd, (secrets.token_hex(32) + "\n").encode())
    os.close(fd)
    took: Dict[str, float] = {}

    def ctl(*args: str, stdin: Optional[str] = None, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=env, input=stdin, capture_output=True,
                           text=True, timeout=timeout, cwd=str(tmp_path))
        if check and r.returncode != 0:
            raise AssertionError("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args[:3]), r.returncode, r.stdout,
                                                                    r.stderr))
        return r

    def ctl_on_a_terminal(args: List[str], typed: str) -> subprocess.CompletedProcess:
        """onboxctl with a terminal as its stdin (a pty), `typed` written to it."""
        import pty

        leader, follower = pty.openpty()
        try:
            p = subprocess.Popen([sys.executable, "-m", "controller", *args], env=env, stdin=follower,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
            os.write(leader, typed.encode())
            out, err = p.communicate(timeout=180)
        finally:
            os.close(follower)
            os.close(leader)
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if r.returncode != 0:
            raise AssertionError("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args), r.returncode, out, err))
        return r

    def step(name: str, t0: float) -> None:
        took[name] = time.monotonic() - t0

    def box_state(run: str) -> Dict:
        try:
            with open(os.path.join(netns_box.home, ".onbox", "runs", run, "state.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    with Started() as started:
        try:
            t = time.monotonic()
            ctl("box", "add", "gpu1", "--host", e["host"], "--user", "root", "--profile", "runpod",
                "--port", str(e["port"]), "--identity", e["identity"], "--python", py)
            step("box add", t)

            t = time.monotonic()
            r = ctl("push", "gpu1", "--code", str(code))
            step("push (a never-seen box)", t)
            known = os.path.join(env["ONBOX_CONFIG_DIR"], "known_hosts")
            assert os.path.getsize(known) > 0, "the box's host key was not recorded on first contact"

            t = time.monotonic()
            port = free_port()
            with open(str(tmp_path / "tracker.out"), "w") as out:  # the child keeps its own copy of the fd
                tracker = started.popen([sys.executable, "-m", "controller", "tracker", "serve", "--token-file",
                                         token, "--port", str(port), "--db", str(tmp_path / "tracker.db")],
                                        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            url = "http://127.0.0.1:%d" % port
            said = wait_for(lambda: (lambda s: s if "dashboard" in s else None)(_text(str(tmp_path / "tracker.out"))),
                            30, "the tracker's lines")
            assert "listening on %s" % url in said and "log in with the token in %s" % token in said, said
            step("tracker serve", t)

            t = time.monotonic()
            with open(token) as f:
                ctl("secrets", "push", "gpu1", "tracker", stdin=f.read())
            step("secrets push", t)

            run_line = ["run", "gpu1", "--durable", "/root/durable", "--tracker", url,
                        "--tracker-token-file", "/root/.onbox/secrets/tracker", "--heartbeat-interval", "5",
                        "--", py, "train.py"]
            t = time.monotonic()
            r = ctl(*run_line)
            step("run", t)
            launched = time.monotonic()
            m = re.search(r"started run (\S+)", r.stdout)
            assert m and "new run %s" % m.group(1) in r.stdout, r.stdout
            run = m.group(1)
            assert tracker.poll() is None

            env["ONBOX_TRACKER"] = url
            with open(token) as f:
                env["ONBOX_TRACKER_TOKEN"] = f.read().strip()
            t = time.monotonic()

            def row():
                rows = json.loads(ctl("status", "--json").stdout)["runs"]
                mine = [x for x in rows if x.get("run") == run and x.get("step")]
                return mine[0] if mine else None

            first = wait_for(row, 60, "the run's step in onboxctl status", 0.5)
            assert first["box"] == "gpu1"
            step("status shows its step", t)

            # -- while nothing can be committed: the trainer saves step_<step>.txt, which onbox ignores by default
            t = time.monotonic()
            ck = "/root/.onbox/runs/%s/checkpoints" % run
            warned = wait_for(lambda: (lambda r: r if r and "no_checkpoint" in r["alerts"] else None)(row()), 120,
                              "the no_checkpoint alert in onboxctl status --json", 0.5)
            step("status says why nothing counts (since the launch)", launched)
            assert warned["checkpoint"] == "none"  # never the durable dir's last part, the run's own name
            [said] = [a for a in warned["alert_details"] if a["code"] == "no_checkpoint"]
            why = re.compile(r"\d+ files in %s, none a checkpoint: step_\d{6}\.txt, step_\d{6}\.txt( and \d+ more)? "
                             r"are \*\.txt, a name onbox ignores by default .* — if they are the trainer's saves, pass "
                             r"--ckpt-pattern '\*\.txt'" % re.escape(ck))
            assert why.match(said["message"]) and said["severity"] == "warning", said
            text = ctl("status").stdout
            [line] = [x for x in text.splitlines() if x.startswith("gpu1 ") and run in x]
            assert line.split()[9] == "none" and re.search(r" -/\d+ ", line) and line.endswith("! no_checkpoint"), text
            assert re.search(r"^  WARN no_checkpoint: \d+ files in %s, none a checkpoint: " % re.escape(ck), text,
                             re.M), text

            # the dashboard, in a real browser: the run list's alert count and cells, the run page's open alerts
            t = time.monotonic()
            browser = request.getfixturevalue("browser")
            page = browser.new_page()
            problems: List[str] = []
            page.on("pageerror", lambda e: problems.append("pageerror: %s" % e))
            with open(token) as f:
                dashboard_login(page, url, f.read().strip())
            page.goto(url + "/?poll=0.5")
            cells = wait_for(lambda: (lambda c: c if c and "no_checkpoint" in c[13] else None)(list_cells(page, run)),
                             30, "the run's alert in the dashboard's list")
            assert cells[9] == "none" and re.fullmatch(r"-/\d+", cells[10]), cells  # durable ckpt, at risk
            assert "1 with alerts" in page.inner_text("#counts")
            page.goto(url + "/run/%s?poll=0.5" % run)
            wait_for(lambda: "none a checkpoint" in page.inner_text("#alerts"), 30, "the run page's open alerts")
            assert "pass --ckpt-pattern '*.txt'" in page.inner_text("#alerts")
            assert page.inner_text("#ckpt").startswith("none: nothing is committed")
            page.screenshot(path=str(tmp_path / "dashboard-nothing-committed.png"), full_page=True)
            step("the dashboard says it", t)

            # stop --wait, pull and down say why nothing was committed
            t = time.monotonic()
            r = ctl("stop", "gpu1", run, "--wait")
            nothing = "nothing committed to /root/durable/%s: " % run
            assert re.search(re.escape(nothing) + r"\d+ files in %s, none a checkpoint: " % re.escape(ck), r.stdout), \
                r.stdout
            r = ctl("pull", "gpu1", run, str(tmp_path / "results"), check=False)
            assert r.returncode == 1 and "(stopped) has no committed checkpoint: " + nothing in r.stderr, r.stderr
            assert "wait for the first sync" not in r.stdout + r.stderr
            r = ctl("down", "gpu1", "--yes", check=False)
            assert r.returncode == 1 and nothing in r.stdout and "none a checkpoint" in r.stdout, r.stdout + r.stderr
            step("stop, pull and down say why", t)

            # -- once it can: the fix the warning names, on the same run line (the same run, resumed)
            run_line = [*run_line[:-3], "--onbox-arg=--ckpt-pattern=*.txt", "--", py, "train.py"]
            t = time.monotonic()
            r = ctl(*run_line)
            assert "resuming %s " % run in r.stdout, r.stdout
            committed = wait_for(lambda: (lambda x: x if x and re.fullmatch(r"step_\d{6}\.txt", x.get("checkpoint")
                                                                           or "") else None)(row()),
                                 120, "a committed checkpoint in onboxctl status --json", 0.5)
            assert "no_checkpoint" not in committed["alerts"] and committed["at_risk"]["durable_step"] is not None
            step("the fix: committed, said everywhere", t)
            text = ctl("status").stdout
            assert "WARN no_checkpoint" not in text and re.search(r" step_\d{6}\.txt +[\d.]+[smh]/\d+ ", text), text
            page.goto(url + "/?poll=0.5")
            cells = wait_for(lambda: (lambda c: c if c and c[9].startswith("step_") else None)(list_cells(page, run)),
                             30, "the committed checkpoint in the dashboard's list")
            assert cells[13] == "" and re.fullmatch(r"[\d.]+[smh]/\d+", cells[10]), cells
            assert "0 with alerts" in page.inner_text("#counts")
            assert problems == []

            def seqs() -> List[int]:
                req = urllib.request.Request("%s/api/v1/runs/%s/heartbeats?after=-1&limit=1000" % (url, run),
                                             headers={"Authorization": "Bearer " + env["ONBOX_TRACKER_TOKEN"]})
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return sorted(b["seq"] for b in json.loads(resp.read())["heartbeats"])

            # a 60 s cut of the box's link; healed without any command typed here
            netns_box.netns.cut()
            try:
                time.sleep(CUT_S)
            finally:
                netns_box.netns.restore()
            t = time.monotonic()
            before = seqs()
            # every beat of the cut arrives (spooled on the box), and new ones after them: no gap in the seqs
            got = wait_for(lambda: (lambda q: q if len(q) >= len(before) + int(CUT_S / 5) else None)(seqs()), 120,
                           "the cut's beats after the heal", 0.5)
            assert got == list(range(got[0], got[0] + len(got))), "a gap in the beats: %s" % got
            step("beats of the 60 s cut arrive (no command)", t)

            # a preemption: SIGTERM to the agent, as the platform sends it; checkpoint, commit, exit 75
            st = box_state(run)
            t = time.monotonic()
            assert kill_exact(st["agent_pid"], st["agent_start_time"], signal.SIGTERM)
            wait_for(lambda: box_state(run).get("state") == "preempted", 60, "the run preempted", 0.2)
            step("preempted (checkpoint, commit)", t)

            # the same line again: the run is found and resumed
            t = time.monotonic()
            log = os.path.join(netns_box.home, ".onbox", "runs", run, "output.log")
            started_before = len(RESUMED.findall(_text(log)))
            r = ctl(*run_line)
            step("the same run line again", t)
            m = re.search(r"resuming %s from step (\d+)" % re.escape(run), r.stdout)
            assert m, r.stdout
            resumed_at = int(m.group(1))
            starts = wait_for(lambda: (lambda s: s if len(s) > started_before else None)(
                [int(x) for x in RESUMED.findall(_text(log))]), 60, "the trainer's resumed start")
            assert starts[-1] == resumed_at > 0, starts

            t = time.monotonic()
            r = ctl("stop", "gpu1", run, "--wait")
            assert "stopped after" in r.stdout and "newest durable checkpoint" in r.stdout, r.stdout
            step("stop --wait", t)

            t = time.monotonic()
            r = ctl("pull", "gpu1", run, str(tmp_path / "results"))
            assert "verified" in r.stdout and "OK" in r.stdout, r.stdout
            step("pull", t)

            t = time.monotonic()
            r = ctl_on_a_terminal(["down", "gpu1"], typed="gpu1\n")  # typing the box name back, as a person does
            assert "Gate passed: every run's newest checkpoint on gpu1 is pulled and verified." in r.stdout, r.stdout
            assert "terminate the pod" in r.stdout, r.stdout
            step("down", t)
        finally:
            print("\nthe README journey, step by step (a netns box, heartbeat 5 s):")
            for name, s in took.items():
                print("  %-45s %6.1f s" % (name, s))
            subprocess.run([*netns_box.netns.exec_prefix(), "true"], capture_output=True)
            stop_tunnel_supervisors(env["ONBOX_CONFIG_DIR"])
            close_masters(cm)
            shutil.rmtree(cm, ignore_errors=True)
            for name in os.listdir(os.path.join(netns_box.home, ".onbox", "runs")) \
                    if os.path.isdir(os.path.join(netns_box.home, ".onbox", "runs")) else []:
                st = box_state(name)
                for k in ("agent", "child"):
                    pid, start = st.get(k + "_pid"), st.get(k + "_start_time")
                    if isinstance(pid, int) and isinstance(start, int) and st.get("state") not in (
                            "done", "failed", "preempted", "stopped", "fenced"):
                        kill_exact(pid, start)
