"""A backward prepared once and launched on new addresses: ``prepare_backward`` does what
fagen.runtime.call.attention_backward does before it launches (the checks, the kernel choice,
the grids, the parameter struct) and keeps it in a ``PreparedBackward``, whose launches write
their addresses into a copy of the parameters, take the TMA maps over those addresses (built
once per combination of them) and enqueue the three kernels. A training loop's backward of a
shape it has run before so costs the host 20 us instead of 100 (bench/host_model.py, on a
2-core CPU).

A launch's tensors have the prepared strides, and its addresses must meet the rules
prepare_backward checked on the prepared ones (non-null, 16-byte aligned); the modifiers'
arrays, the workspace and the semaphores are attention_backward's.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

from .. import contract
from ..abi import BwdParams
from ..contract import KernelEntry
from . import driver
from .call import (AttentionError, BackwardTensors, Problem, ScoreTensors, Varlen, _bwd_params, _checked_backward,
                   backward_workspace, bwd_tma_maps)
from .loader import Bundle, LoadedKernel

# Address combinations whose TMA maps a PreparedBackward keeps (a model's layers of one shape
# each have their own); past that it starts over.
_MAPS_KEPT = 1024


class BackwardPointers(NamedTuple):
    """The addresses of one backward's tensors: BackwardTensors without the strides."""

    q: int
    k: int
    v: int
    out: int
    dout: int
    dq: int
    dk: int
    dv: int
    lse: int

    @classmethod
    def of(cls, tensors: BackwardTensors) -> BackwardPointers:
        return cls(*(getattr(tensors, name).data for name in cls._fields[:-1]), tensors.lse)


@dataclass(frozen=True)
class PreparedBackward:
    """A checked, selected and parameterised backward; ``launch`` adds the addresses."""

    kernel: LoadedKernel
    grid: tuple[int, int, int]
    rows: tuple[int, int, int]  # the preprocess's and the dQ conversion's grid
    params: bytes  # FagenBwdParams of the prepared call, whose addresses every launch replaces
    workspace: contract.BackwardWorkspace  # the buffers a launch takes: their sizes, the offsets in them
    deterministic: bool  # whether a launch takes semaphores
    device: int
    # What the TMA maps are made of (bwd_tma_maps): the prepared call's problem, strides, packing.
    problem: Problem
    tensors: BackwardTensors
    varlen: Varlen | None
    _maps: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def enqueue(self, pointers: BackwardPointers, workspace: int, semaphores: int, stream: int,
                score_tensors: ScoreTensors = ScoreTensors(), varlen: Varlen | None = None) -> None:
        """launch() for a caller that made the device's primary context current."""
        if not workspace:
            raise AttentionError(f"the backward needs a workspace of {self.workspace.floats} fp32")
        if bool(semaphores) != self.deterministic:
            raise AttentionError("semaphores are the deterministic mode's: given exactly when prepared "
                                 f"with deterministic=True (prepared with {self.deterministic})")
        if (varlen is None) != (self.varlen is None):
            raise AttentionError("a varlen backward launches with its Varlen packing, a dense one without")
        params = BwdParams.from_buffer_copy(self.params)
        (params.q, params.k, params.v, params.o, params.dout, params.dq, params.dk, params.dv,
         params.lse) = pointers
        layout = self.workspace
        dq_accum = workspace + 4 * layout.dq_accum
        params.dq_accum, params.softmax_d = dq_accum, workspace + 4 * layout.softmax_d
        params.lse_log2, params.sink_partials = workspace + 4 * layout.lse_log2, workspace + 4 * layout.sink_partials
        params.dq_semaphore = semaphores
        params.alibi_slopes, params.sinks = score_tensors.alibi_slopes, score_tensors.sinks
        params.dsinks, params.mask_args = score_tensors.dsinks, score_tensors.mask_args
        if varlen is not None:
            params.cu_seqlens_q, params.cu_seqlens_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
        extra = (self._tma_maps(pointers, dq_accum),) if self.kernel.entry.launch.tma_q_rows else ()
        self.kernel.enqueue_backward(params, self.grid, self.rows, stream, self.device, extra)

    def launch(self, pointers: BackwardPointers, *, workspace: int, semaphores: int = 0, stream: int = 0,
               score_tensors: ScoreTensors = ScoreTensors(), varlen: Varlen | None = None) -> None:
        """Enqueue on `stream` the gradients of the tensors at `pointers` (strides as prepared);
        the other arguments as attention_backward takes them (`semaphores` where prepared
        deterministic, `varlen` where prepared with one, of the same totals)."""
        with driver.primary_context(self.device):
            self.enqueue(pointers, workspace, semaphores, stream, score_tensors, varlen)

    def _tma_maps(self, pointers: BackwardPointers, dq_accum: int) -> ctypes.Array:
        """bwd_tma_maps over a launch's addresses, kept by them: a caching allocator hands a
        loop's calls the same addresses again."""
        addresses = (pointers.q, pointers.k, pointers.v, pointers.dout, dq_accum)
        maps = self._maps.get(addresses)
        if maps is None:
            moved = {name: dataclasses.replace(getattr(self.tensors, name), data=address)
                     for name, address in zip(("q", "k", "v", "dout"), addresses)}
            maps = bwd_tma_maps(self.problem, dataclasses.replace(self.tensors, **moved), self.kernel.entry.launch,
                                dq_accum, self.varlen)
            if len(self._maps) >= _MAPS_KEPT:
                self._maps.clear()
            self._maps[addresses] = maps
        return maps


def prepare_backward(bundle: Bundle, problem: Problem, tensors: BackwardTensors, *, deterministic: bool = False,
                     softmax_scale: float | None = None, device: int = 0, entry: KernelEntry | None = None,
                     score_tensors: ScoreTensors = ScoreTensors(), varlen: Varlen | None = None) -> PreparedBackward:
    """attention_backward's checks of `tensors`, `score_tensors` and `varlen`, its kernel choice
    (select_backward(), unless `entry` names one of the bundle's kernels), grids and parameters,
    for launches on tensors of the same strides; `deterministic`: launches take semaphores.
    Raises like attention_backward."""
    entry, grid, rows, scale = _checked_backward(bundle, problem, tensors, deterministic, softmax_scale, device,
                                                 entry, score_tensors, varlen)
    layout = backward_workspace(entry, problem, None if varlen is None else varlen.total_q)
    params = _bwd_params(problem, tensors, layout, 0, 0, scale, softmax_scale, score_tensors, varlen)
    return PreparedBackward(bundle.kernel(entry), grid, rows, bytes(params), layout, deterministic, device,
                            problem, tensors, varlen)
