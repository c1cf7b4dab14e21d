"""A stand-in `docker` CLI for machines without a Docker daemon (tests/fakes/docker.install puts it on PATH).

It behaves, for what onbox relies on, like the real client with a daemon behind it, with real processes:
- `docker run [OPTIONS] IMAGE CMD...` (attached): records its argv (one JSON line in $FAKE_DOCKER_LOG), writes the
  cidfile, starts CMD as the "container": in its OWN session (a real container is no child of the client's
  process group: a signal to the client's group never reaches it), with an environment of only the `-e NAME`
  variables (values from the client's own environment) plus the image's PATH and HOME, in `-w DIR`. It forwards
  TERM, INT, HUP, USR1 and USR2 to the container (--sig-proxy), waits for it, removes its record (--rm) and exits
  with its code (128+N when a signal N ended it). `-d`/`--detach` is refused like a test failure would be.
- `docker stop [--time T] REF`: TERM to the container, KILL after T seconds; `docker kill [--signal S] REF`.
  REF is a name or a container id; an unknown one answers "No such container" and exit 1, as docker does.
- `docker info`: no daemon here (exit 1).
Containers are recorded in $FAKE_DOCKER_STATE/<name>.json: {"id", "name", "pid"}.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

STATE = os.environ.get("FAKE_DOCKER_STATE", "/tmp/fake-docker")
LOG = os.environ.get("FAKE_DOCKER_LOG")
VALUED = {"--name", "--cidfile", "-e", "--env", "-w", "--workdir", "-v", "--volume", "--label", "--shm-size",
          "--gpus", "--network", "--ipc", "--user", "-u"}


def record(argv):
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"argv": argv, "pid": os.getpid()}) + "\n")


def containers():
    out = []
    for fn in os.listdir(STATE) if os.path.isdir(STATE) else []:
        try:
            with open(os.path.join(STATE, fn)) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue
    return out


def find(ref):
    for c in containers():
        if ref in (c["name"], c["id"]) or (len(ref) >= 12 and c["id"].startswith(ref)):
            return c
    return None


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def run(args):
    opts = {"env": [], "name": None, "cidfile": None, "workdir": None}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        tok = args[i]
        key, eq, val = tok.partition("=")
        if key in ("-d", "--detach"):
            sys.stderr.write("fake docker: -d is not supported\n")
            return 125
        if key in VALUED:
            if not eq:
                i += 1
                val = args[i]
            if key in ("-e", "--env"):
                opts["env"].append(val)
            elif key == "--name":
                opts["name"] = val
            elif key == "--cidfile":
                opts["cidfile"] = val
            elif key in ("-w", "--workdir"):
                opts["workdir"] = val
        i += 1
    image, cmd = args[i], args[i + 1:]
    cid = os.urandom(32).hex()
    name = opts["name"] or "fake_" + cid[:8]
    if find(name):
        sys.stderr.write('docker: Error response from daemon: Conflict. The container name "/%s" is already in use.\n'
                         % name)
        return 125
    if opts["cidfile"]:
        if os.path.exists(opts["cidfile"]):
            sys.stderr.write("docker: Container ID file found, make sure the other container isn't running\n")
            return 125
        with open(opts["cidfile"], "w") as f:
            f.write(cid)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root", "HOSTNAME": cid[:12]}
    for item in opts["env"]:
        k, eq, v = item.partition("=")
        if eq:
            env[k] = v
        elif k in os.environ:
            env[k] = os.environ[k]
    proc = subprocess.Popen(cmd, env=env, cwd=opts["workdir"], start_new_session=True)
    os.makedirs(STATE, exist_ok=True)
    path = os.path.join(STATE, name + ".json")
    with open(path, "w") as f:
        json.dump({"id": cid, "name": name, "pid": proc.pid, "image": image}, f)

    def proxy(sig, _frame):
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, proxy)
    code = proc.wait()
    try:
        os.unlink(path)  # --rm
    except OSError:
        pass
    return code if code >= 0 else 128 - code


def stop(args, default_sig=signal.SIGTERM, kill_only=False):
    sig, wait = default_sig, 10.0
    i = 0
    while i < len(args) - 1:
        if args[i] in ("--time", "-t"):
            wait = float(args[i + 1])
            i += 2
        elif args[i] in ("--signal", "-s"):
            sig = getattr(signal, "SIG" + args[i + 1].upper().replace("SIG", ""))
            i += 2
        else:
            break
    ref = args[-1]
    c = find(ref)
    if c is None or not alive(c["pid"]):
        sys.stderr.write("Error response from daemon: No such container: %s\n" % ref)
        return 1
    os.kill(c["pid"], sig)
    if not kill_only:
        deadline = time.monotonic() + wait
        while alive(c["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(c["pid"]):
            os.kill(c["pid"], signal.SIGKILL)
    print(ref)
    return 0


def main(argv):
    record(argv)
    if not argv:
        return 1
    if argv[0] == "run":
        return run(argv[1:])
    if argv[0] == "stop":
        return stop(argv[1:])
    if argv[0] == "kill":
        return stop(argv[1:], signal.SIGKILL, kill_only=True)
    if argv[0] == "info":
        sys.stderr.write("Cannot connect to the Docker daemon (fake docker: no daemon)\n")
        return 1
    sys.stderr.write("fake docker: %s is not faked\n" % argv[0])
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
