"""Options of the test suite (pytest reads them from the top conftest only)."""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("fagen differential test (tests/gpu/test_differential.py)")
    group.addoption("--differential-cases", type=int, default=150,
                    help="random forward + backward cases to run (the long pass: 5000)")
    group.addoption("--differential-seconds", type=float, default=120.0,
                    help="stop drawing new cases after this many seconds")
    group.addoption("--differential-seed", type=int, default=0, help="the first case's seed")
