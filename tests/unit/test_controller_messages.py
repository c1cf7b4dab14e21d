"""What onboxctl says, built without a box: the tracker's start-up lines, the status table's heartbeat hint, what a
pull's verification says it checked, and the teardown gate's sentences for every profile."""
from __future__ import annotations

import os

import pytest


# -- onboxctl tracker serve ------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,tls,listen,dash", [
    ("127.0.0.1", False, "http://127.0.0.1:8787 (", "dashboard http://127.0.0.1:8787/; "),
    ("localhost", True, "https://localhost:8787 (", "dashboard https://localhost:8787/; "),
    ("::1", False, "http://[::1]:8787 (", "dashboard http://[::1]:8787/; "),
    ("0.0.0.0", True, "https://0.0.0.0:8787, every address of this machine (",
     "dashboard https://127.0.0.1:8787/ (from elsewhere: this machine's name or address); "),
    ("::", False, "http://[::]:8787, every address of this machine (",
     "dashboard http://[::1]:8787/ (from elsewhere: this machine's name or address); "),
])
def test_tracker_announcement_names_the_address_the_dashboard_and_the_token(host, tls, listen, dash):
    from controller.commands.tracker import announcement

    lines = announcement(host, 8787, tls, "in /home/me/.onbox-token", False, "/home/me/t.db")
    assert lines == ["onboxctl tracker: listening on %spid %d, database /home/me/t.db)" % (listen, os.getpid()),
                     "onboxctl tracker: %slog in with the token in /home/me/.onbox-token" % dash]
