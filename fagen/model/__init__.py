"""Stage 1: kernel specs (one pydantic model per algorithm with its validation and tuning rows,
the tile resolver, naming, YAML expansion, the generated spec reference)."""

from .algorithms import ALGORITHMS, SPEC_CLASSES, algorithm_for, available
from .arch import ARCHS, Arch, ArchInfo
from .base import Constexpr, KernelSpec, TileBase
from .specfile import Expansion, SpecError, expand, load_spec_file

__all__ = [
    "ALGORITHMS", "SPEC_CLASSES", "algorithm_for", "available", "ARCHS", "Arch", "ArchInfo",
    "Constexpr", "KernelSpec", "TileBase", "Expansion", "SpecError", "expand", "load_spec_file",
]
