"""GPU test fixtures. Imports nothing from the build stack (no pydantic on the GPU machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bundle():
    """The bundle under test: $FAGEN_BUNDLE, else fagen's default bundle; skips without one."""
    from fagen.torch import bundle_path, get_bundle

    path = bundle_path()
    if not (path / "manifest.json").is_file():
        pytest.skip(f"no fagen bundle at {path}: set FAGEN_BUNDLE or run `fagen build`")
    return get_bundle(path)

