"""Stage 1: kernel specs (pydantic models, validation, tuning table, naming, YAML expansion)."""

from .algorithms import ALGORITHMS, Algorithm, algorithm_for
from .arch import ARCHS, Arch, ArchInfo
from .model import KernelSpec, TileConfig
from .specfile import Expansion, SpecError, expand, load_spec_file

__all__ = [
    "ALGORITHMS", "Algorithm", "algorithm_for", "ARCHS", "Arch", "ArchInfo",
    "KernelSpec", "TileConfig", "Expansion", "SpecError", "expand", "load_spec_file",
]
