"""The softmax-scale rule of the contract (fagen/contract.py re-exports it): which
``softmax_scale`` values the kernels answer correctly, and the ``scale_log2`` (and with a
softcap the ``softcap_scale``) they are launched with. Standard library only, like the contract.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

LOG2_E = math.log2(math.e)
# The kernels take the running maximum of the raw scores and compute exp2(s * c - m * c) with
# c = softmax_scale * log2(e): exact for c > 0. For c < 0 the maximum of the scaled scores is the
# minimum of the raw ones, so the kernels would overflow: refused. For c = 0 a masked score
# (-inf) times c is NaN: c is raised to the smallest normal fp32 instead, where every
# exponential of a score below 2^100 in magnitude rounds to exactly 1 in fp32, i.e. the uniform
# attention that scale 0 means (the mean of the values a row sees); LSE = ln(keys seen).
MIN_SCALE_LOG2 = 2.0 ** -126
_FP32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


class ScaleError(ValueError):
    """A softmax_scale the kernels cannot answer correctly."""


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def kernel_scale_log2(softmax_scale: float | None, head_dim: int) -> float:
    """The `scale_log2` (params.h) a call with `softmax_scale` launches with (None: the default
    1/sqrt(head_dim)); raises ScaleError for NaN, infinities, negative scales and scales whose
    base-2 form overflows fp32. Mirrored by fagen.hpp's kernel_scale_log2."""
    if softmax_scale is None:
        softmax_scale = default_softmax_scale(head_dim)
    scale = float(softmax_scale)
    if math.isnan(scale) or math.isinf(scale):
        raise ScaleError(f"softmax_scale={scale}: must be a finite number")
    if scale < 0:
        raise ScaleError(
            f"softmax_scale={scale}: must be >= 0 (fagen's kernels take the running maximum of "
            "the unscaled scores); for a negative scale pass -q and softmax_scale=|scale|")
    scale_log2 = scale * LOG2_E
    if scale_log2 > _FP32_MAX:
        raise ScaleError(f"softmax_scale={scale}: softmax_scale * log2(e) overflows float32")
    return max(scale_log2, MIN_SCALE_LOG2)


@dataclass(frozen=True)
class KernelScale:
    """What a call's softmax_scale and softcap launch with (FagenFwdParams scale_log2,
    softcap_scale): without a softcap scale_log2 = softmax_scale * log2(e); with one the kernels
    take tanh(softcap_scale * s) for the raw score s, softcap_scale = softmax_scale / softcap,
    and scale_log2 = softcap * log2(e) (templates/include/fagen/algo/score.cuh)."""

    scale_log2: float
    softcap_scale: float = 0.0


def kernel_score_scale(softmax_scale: float | None, head_dim: int, softcap: float = 0.0) -> KernelScale:
    """kernel_scale_log2, and the softcap's form of it; raises ScaleError. Mirrored by
    fagen.hpp's kernel_score_scale."""
    scale_log2 = kernel_scale_log2(softmax_scale, head_dim)
    if not softcap > 0:
        return KernelScale(scale_log2)
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    return KernelScale(max(float(softcap) * LOG2_E, MIN_SCALE_LOG2), scale / float(softcap))
