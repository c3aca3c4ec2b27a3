"""Which algorithm has a template, and on which targets it may run."""

from __future__ import annotations

from dataclasses import dataclass

from .arch import Arch


@dataclass(frozen=True)
class Algorithm:
    fa_version: int
    direction: str
    template: str  # path under templates/kernels/
    archs: tuple[Arch, ...]
    why_archs: str
    # SASS instruction families every cubin of this algorithm must contain.
    required_sass: tuple[str, ...]


ALGORITHMS: dict[tuple[int, str], Algorithm] = {
    (2, "fwd"): Algorithm(
        fa_version=2,
        direction="fwd",
        template="fa2_fwd_sm80.cu.j2",
        archs=(Arch.sm80, Arch.sm86, Arch.sm89, Arch.sm90, Arch.sm100a, Arch.sm120),
        why_archs="mma.sync m16n8k16, ldmatrix and cp.async exist from sm80 on; sm90a adds "
        "nothing it uses, so Hopper takes the plain sm90 build",
        required_sass=("HMMA", "LDSM", "LDGSTS"),
    ),
}


def algorithm_for(fa_version: int, direction: str) -> Algorithm | None:
    return ALGORITHMS.get((fa_version, direction))
