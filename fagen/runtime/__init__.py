"""Stage 5: load bundles and launch their kernels through the CUDA driver (cuda.bindings).

Imports neither pydantic, Jinja nor NVRTC: a deployed process needs only the bundle and
cuda-bindings.
"""

from ..bundle.format import BundleError
from ..contract import KernelEntry, ScaleError, Score, ScoreError
from .call import (
    AttentionError, BackwardTensors, PreparedAttention, Problem, ScoreTensors, Tensor, attention,
    attention_backward, prepare,
)
from .driver import DriverError
from .e4m3 import Descales
from .loader import Bundle, KernelNotFound, LoadedKernel, launch_grid, load, runs_on
from .prepared import BackwardPointers, PreparedBackward, prepare_backward

__all__ = [
    "AttentionError", "BackwardPointers", "BackwardTensors", "Bundle", "BundleError", "Descales", "DriverError",
    "KernelEntry", "KernelNotFound", "LoadedKernel", "PreparedAttention", "PreparedBackward", "Problem",
    "ScaleError", "Score", "ScoreError", "ScoreTensors", "Tensor",
    "attention", "attention_backward",
    "launch_grid", "load", "prepare", "prepare_backward", "runs_on",
]
