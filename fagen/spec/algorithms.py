"""Which algorithm has a template, and on which targets it may run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .arch import Arch
from .fa2 import Fa2Geometry
from .fa3 import Fa3Geometry
from .fa4 import Fa4Geometry


def _fa2_geometry(head_dim: int, tile: Any) -> Fa2Geometry:
    return Fa2Geometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages)


def _fa3_geometry(head_dim: int, tile: Any) -> Fa3Geometry:
    return Fa3Geometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages,
                       tile.warp_specialized, tile.pingpong, tile.intra_wg_overlap,
                       tile.persistent, tile.early_first_qk, tile.peel_masked_blocks,
                       tile.mma_row_sum)


def _fa4_geometry(head_dim: int, tile: Any) -> Fa4Geometry:
    return Fa4Geometry(head_dim, tile.block_m, tile.block_n, tile.warps, tile.stages)


@dataclass(frozen=True)
class Algorithm:
    fa_version: int
    direction: str
    template: str  # path under templates/kernels/
    archs: tuple[Arch, ...]
    why_archs: str
    # SASS instruction families every cubin of this algorithm must contain.
    required_sass: tuple[str, ...]
    # (head_dim, tile) -> the geometry object that validates the tile and derives constants.
    geometry: Callable[[int, Any], Any]
    # Tile flags this template understands; any other flag set is rejected.
    tile_flags: tuple[str, ...] = ()


ALGORITHMS: dict[tuple[int, str], Algorithm] = {
    (2, "fwd"): Algorithm(
        fa_version=2,
        direction="fwd",
        template="fa2_fwd_sm80.cu.j2",
        archs=(Arch.sm80, Arch.sm86, Arch.sm89, Arch.sm90, Arch.sm100a, Arch.sm120),
        why_archs="mma.sync m16n8k16, ldmatrix and cp.async exist from sm80 on; sm90a adds "
        "nothing it uses, so Hopper takes the plain sm90 build",
        required_sass=("HMMA", "LDSM", "LDGSTS"),
        geometry=_fa2_geometry,
        tile_flags=("exp2_emulation", "rescale_threshold"),
    ),
    (3, "fwd"): Algorithm(
        fa_version=3,
        direction="fwd",
        template="fa3_fwd_sm90.cu.j2",
        archs=(Arch.sm90a,),
        why_archs="wgmma and setmaxnreg exist only on sm_90a",
        required_sass=("HGMMA", "UTMALDG", "SYNCS"),
        geometry=_fa3_geometry,
        tile_flags=("warp_specialized", "pingpong", "intra_wg_overlap", "persistent",
                    "early_first_qk", "peel_masked_blocks", "mma_row_sum", "exp2_emulation",
                    "rescale_threshold"),
    ),
    (4, "fwd"): Algorithm(
        fa_version=4,
        direction="fwd",
        template="fa4_fwd_sm100.cu.j2",
        archs=(Arch.sm100a,),
        why_archs="tcgen05 (MMA into Tensor Memory) exists only on sm_100a",
        # UTCHMMA: tcgen05.mma kind::f16; LDTM: tcgen05.ld; UTCBAR: tcgen05.commit.
        required_sass=("UTCHMMA", "LDTM", "UTCBAR", "UTMALDG"),
        geometry=_fa4_geometry,
        tile_flags=("exp2_emulation", "rescale_threshold"),
    ),
}


def algorithm_for(fa_version: int, direction: str) -> Algorithm | None:
    return ALGORITHMS.get((fa_version, direction))
