"""Pieces every kernel geometry shares: element size, the shared-memory limit check, and the
TMA ring layout of the FA3 and FA4 kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .arch import MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM

ELEMENT_BYTES = 2  # fp16 / bf16: the element of the algorithms whose DTYPES are those alone
SWIZZLE_ATOM_BYTES = 1024  # 8 rows x 128 bytes: every TMA tile starts on this boundary
TMA_COLUMNS = 64  # 128-byte swizzle: a TMA box (and a wgmma atom) is 64 fp16/bf16 columns wide
SWIZZLE_ROW_BYTES = 128  # ... and 128 bytes whatever the element
MBARRIERS_PER_STAGE = 4  # per K/V ring stage: k_full, k_empty, v_full, v_empty
SETMAXNREG_GRANULE = 8  # setmaxnreg counts are multiples of 8


def launch_registers(threads: int) -> int:
    """Registers per thread a CTA of `threads` holds from its launch (__launch_bounds__(threads,
    1)): 168 at 384 threads, 128 at 512. setmaxnreg only moves these between warpgroups: a split
    that asks for more in all blocks the increase forever (run 74 hung on 32 + 2 x 240 > 3 x 168)."""
    per_thread = min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // threads)
    return per_thread // SETMAXNREG_GRANULE * SETMAXNREG_GRANULE


def consumer_registers(threads: int, consumers: int, producer_registers: int) -> int:
    """setmaxnreg of each of `consumers` warpgroups when the producer warpgroup keeps
    `producer_registers`: what is left of the launch's registers, in granules."""
    share = (launch_registers(threads) * (consumers + 1) - producer_registers) // consumers
    return min(MAX_REGISTERS_PER_THREAD, share) // SETMAXNREG_GRANULE * SETMAXNREG_GRANULE


def value_dim_rule(head_dim_problem: Callable[[int], str | None],
                   why: str) -> Callable[[int, int], str | None]:
    """A HEAD_DIM_V_RULE (fagen/model/base.py) for an algorithm whose v head dim must be one of
    its head dims and at most q/k's, `why` saying what bounds it."""
    def rule(head_dim: int, head_dim_v: int) -> str | None:
        if problem := head_dim_problem(head_dim_v):
            return problem
        if head_dim_v > head_dim:
            return f"it needs head_dim_v <= head_dim ({why})"
        return None
    return rule


def smem_limit_problems(geometry, max_smem: int) -> list[str]:
    """The message for a tile over the target's shared memory (empty when it fits)."""
    if geometry.smem_bytes <= max_smem:
        return []
    return [
        f"tile (block_m={geometry.block_m}, block_n={geometry.block_n}, stages={geometry.stages}) "
        f"needs {geometry.smem_bytes} bytes of shared memory at {geometry.head_dims}; "
        f"the arch allows {max_smem}"
    ]


@dataclass(frozen=True)
class TileGeometry:
    """The fields of every kernel geometry, in the positional order of their constructors;
    head_dim is q and k's, head_dim_v v's and the output's (None: head_dim); element_bytes the
    size of q, k and v's element (contract.DTYPE_BYTES)."""

    head_dim: int
    block_m: int
    block_n: int
    warps: int
    stages: int
    head_dim_v: int | None = field(default=None, kw_only=True)
    element_bytes: int = field(default=ELEMENT_BYTES, kw_only=True)

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def head_dims(self) -> str:
        """The head dims, as the messages name them."""
        if self.head_dim_v == self.head_dim:
            return f"head_dim={self.head_dim}"
        return f"head_dim={self.head_dim}, head_dim_v={self.head_dim_v}"


@dataclass(frozen=True)
class TmaRingLayout(TileGeometry):
    """Shared memory of the TMA kernels: `q_stages` Q tiles, then `stages` K tiles, then
    `stages` V stages (a V tile each, and what a kernel keeps beside it), then the control block
    (mbarriers, ...); every offset stays a multiple of SWIZZLE_ATOM_BYTES because block_m,
    block_n are multiples of 8 and head_dim, head_dim_v of 64."""

    @property
    def q_stages(self) -> int:
        return 1

    @property
    def smem_q_offset(self) -> int:
        return 0

    @property
    def smem_q_tile_bytes(self) -> int:
        return self.block_m * self.head_dim * self.element_bytes

    @property
    def smem_k_offset(self) -> int:
        return self.q_stages * self.smem_q_tile_bytes

    @property
    def smem_kv_tile_bytes(self) -> int:
        """A K tile (block_n x head_dim)."""
        return self.block_n * self.head_dim * self.element_bytes

    @property
    def smem_v_tile_bytes(self) -> int:
        """A V tile (block_n x head_dim_v)."""
        return self.block_n * self.head_dim_v * self.element_bytes

    @property
    def smem_v_offset(self) -> int:
        return self.smem_k_offset + self.stages * self.smem_kv_tile_bytes

    @property
    def smem_v_stage_bytes(self) -> int:
        """A V stage: the V tile, and whatever a kernel keeps beside it."""
        return self.smem_v_tile_bytes

    @property
    def smem_barrier_offset(self) -> int:
        return self.smem_v_offset + self.stages * self.smem_v_stage_bytes

    @property
    def smem_control_bytes(self) -> int:
        """The control block after the tiles (each kernel's mbarriers, ...)."""
        raise NotImplementedError

    @property
    def smem_bytes(self) -> int:
        # + one atom of slack: the kernel rounds the dynamic window up to 1024-byte alignment.
        return self.smem_barrier_offset + self.smem_control_bytes + SWIZZLE_ATOM_BYTES
