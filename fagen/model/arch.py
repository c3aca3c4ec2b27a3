"""What each target architecture offers: the limits the spec validates against."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Arch(str, Enum):
    sm80 = "sm80"
    sm86 = "sm86"
    sm89 = "sm89"
    sm90 = "sm90"
    sm90a = "sm90a"
    sm100a = "sm100a"
    sm120 = "sm120"


@dataclass(frozen=True)
class ArchInfo:
    compute_capability: tuple[int, int]
    # Largest dynamic shared memory one CTA may opt into (CUDA C Programming Guide, "Technical
    # Specifications per Compute Capability"): 163 KB on 8.0, 99 KB on 8.6/8.9/12.x, 227 KB on
    # 9.0 and 10.0.
    max_smem_per_block: int
    # Architecture-specific ("a") cubins run only on exactly this compute capability; plain ones
    # also run on later minor revisions of the same major version.
    arch_specific: bool

    @property
    def nvrtc_arch(self) -> str:
        """The value of NVRTC's -arch= option (always a real sm_ target: we ship SASS only)."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}{'a' if self.arch_specific else ''}"


ARCHS: dict[Arch, ArchInfo] = {
    Arch.sm80: ArchInfo((8, 0), 163 * 1024, False),
    Arch.sm86: ArchInfo((8, 6), 99 * 1024, False),
    Arch.sm89: ArchInfo((8, 9), 99 * 1024, False),
    Arch.sm90: ArchInfo((9, 0), 227 * 1024, False),
    Arch.sm90a: ArchInfo((9, 0), 227 * 1024, True),
    Arch.sm100a: ArchInfo((10, 0), 227 * 1024, True),
    Arch.sm120: ArchInfo((12, 0), 99 * 1024, False),
}

# Registers one thread may hold (the ISA limit on every target fagen knows).
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_SM = 64 * 1024

