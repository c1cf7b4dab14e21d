"""The frameworks' own venv (build/out/frameworks-venv): built by `make frameworks-venv` (which `make test` depends
on) from the pinned build/frameworks-requirements.txt. Without it a test skips, saying how to build it, except in
CI (CI=true), where that is a failure (tests.hosts.require_built)."""
from __future__ import annotations

import os
from typing import Optional

from tests.conftest import REPO_ROOT

VENV = os.path.join(REPO_ROOT, "build", "out", "frameworks-venv")
STAMP = os.path.join(VENV, ".installed")
PYTHON = os.path.join(VENV, "bin", "python")
SCRIPTS = os.path.dirname(os.path.abspath(__file__))


def unavailable_reason() -> Optional[str]:
    if not os.path.exists(STAMP) or not os.access(PYTHON, os.X_OK):
        return ("no frameworks venv at %s (JAX, Flax, Optax, orbax-checkpoint, Keras 3, XGBoost, numpy): build it "
                "with `make frameworks-venv` (make test does)" % VENV)
    return None


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)
