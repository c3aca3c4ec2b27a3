"""Options of the test suite (pytest reads them from the top conftest only)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_CACHE_ROOT = pytest.StashKey[Path]()


def pytest_configure(config):
    """The suite's caches (kernels, NVRTC's headers, the bundle writers' lock files, unpacked
    bundles) live in a directory of the session's own, removed at its end, not in the user's;
    a FAGEN_CACHE or FAGEN_BUNDLE_CACHE the caller set is used as given."""
    root = Path(tempfile.mkdtemp(prefix="fagen-tests-"))
    config.stash[_CACHE_ROOT] = root
    os.environ.setdefault("FAGEN_CACHE", str(root / "cache"))
    os.environ.setdefault("FAGEN_BUNDLE_CACHE", str(root / "bundles"))


def pytest_unconfigure(config):
    shutil.rmtree(config.stash[_CACHE_ROOT], ignore_errors=True)


def pytest_addoption(parser):
    group = parser.getgroup("fagen differential test (tests/gpu/test_differential.py)")
    group.addoption("--differential-cases", type=int, default=150,
                    help="random forward + backward cases to run (the long pass: 5000)")
    group.addoption("--differential-seconds", type=float, default=120.0,
                    help="stop drawing new cases after this many seconds")
    group.addoption("--differential-seed", type=int, default=0, help="the first case's seed")
    group.addoption("--differential-score-share", type=float, default=0.25,
                    help="share of the cases that draw score modifiers where the bundle has the variant")
