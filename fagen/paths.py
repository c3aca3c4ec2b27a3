"""Where fagen's data lives: the repo checkout (editable install) or the wheel's _data/."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent


def _data_dir(name: str) -> Path:
    in_checkout = _CHECKOUT / name
    return in_checkout if in_checkout.is_dir() else _PACKAGE / "_data" / name


def templates_dir() -> Path:
    return _data_dir("templates")


def include_dir() -> Path:
    return templates_dir() / "include"


def specs_dir() -> Path:
    return _data_dir("specs")


def default_spec() -> Path:
    return specs_dir() / "default.yaml"


def generated_dir() -> Path:
    """Build output root: FAGEN_HOME if set, else the checkout's generated/, else ~/.cache/fagen."""
    if env := os.environ.get("FAGEN_HOME"):
        return Path(env)
    if (_CHECKOUT / "pyproject.toml").is_file():
        return _CHECKOUT / "generated"
    return Path.home() / ".cache" / "fagen"


def default_bundle_dir() -> Path:
    return generated_dir() / "default"


def cache_root() -> Path:
    """Where fagen keeps machine-local caches: FAGEN_CACHE if set, else ~/.cache/fagen.

    Holds `kernels/` (compiled cubins, fagen.compiler.cache) and `nvrtc-headers/` (NVRTC's
    bundled headers, fagen.compiler.headers). Lives here, free of NVRTC, so that `fagen cache`
    can find it without importing the compiler.
    """
    if env := os.environ.get("FAGEN_CACHE"):
        return Path(env)
    return Path.home() / ".cache" / "fagen"
