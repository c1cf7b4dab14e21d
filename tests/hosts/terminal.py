"""A command on a pseudo-terminal, an answer typed at its prompt: what a person at `onboxctl down`'s confirmation
sees and does."""
from __future__ import annotations

import os
import pty
import subprocess
import sys
from typing import Dict, Tuple


def down_on_a_terminal(env: Dict[str, str], box: str, answer: str) -> Tuple[int, str]:
    """`onboxctl down BOX` on a pseudo-terminal, `answer` typed at its prompt: (exit code, the screen)."""
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "controller", "down", box], env=env, stdin=follower, stdout=follower,
                         stderr=follower)
    os.close(follower)
    screen = b""
    while b"Type the box name" not in screen or not screen.endswith(b": "):  # the prompt, whole
        chunk = os.read(leader, 4096)
        assert chunk, screen
        screen += chunk
    os.write(leader, (answer + "\n").encode())
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO once the child has closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    rc = p.wait(timeout=60)
    os.close(leader)
    return rc, screen.decode("utf-8", "replace")
