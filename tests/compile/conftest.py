"""Bundles built once per test session, with a kernel cache of the session's own."""

from __future__ import annotations

import os

import pytest

from fagen import paths
from fagen.build import build_bundle
from fagen.model import load_spec_file

JOBS = os.cpu_count() or 1


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def ci_small(tmp_path_factory, kernel_cache):
    """(bundle dir, BuildReport) of specs/ci-small.yaml."""
    out = tmp_path_factory.mktemp("bundles") / "ci-small"
    expansion = load_spec_file(paths.specs_dir() / "ci-small.yaml")
    return out, build_bundle(expansion, out, jobs=JOBS, cache_dir=kernel_cache)
