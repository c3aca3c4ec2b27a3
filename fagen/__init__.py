"""fagen: ahead-of-time FlashAttention kernels as versioned cubin bundles."""

from ._version import __version__

__all__ = ["__version__", "load"]


def load(path=None):
    """Load a bundle directory or packed bundle file (see fagen.runtime.load). Imports the
    runtime only when called."""
    from .runtime import load as _load

    return _load(path)
