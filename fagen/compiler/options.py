"""NVRTC options per target architecture.

Deliberately absent: `-G` (after one debug compile, later release compiles in the same process
change), `-lineinfo` (cubins stop being byte-stable) and `--use_fast_math` (the kernels call
ex2.approx explicitly where they want it; fast math would also approximate everything else).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..paths import include_dir
from ..model import ARCHS, Arch
from .headers import bundled_include_dirs


@dataclass(frozen=True)
class NvrtcOptions:
    # Flags that decide the generated code; portable across machines, so they enter cache keys
    # and the fingerprint. Include dirs are absolute paths and do not: what they hold is hashed
    # instead (fagen's headers by content, NVRTC's bundled ones through the NVRTC version).
    flags: tuple[str, ...]
    include_dirs: tuple[Path, ...]

    def as_nvrtc(self) -> list[bytes]:
        return [f.encode() for f in self.flags] + [f"-I{d}".encode() for d in self.include_dirs]


def code_flags(arch: Arch) -> tuple[str, ...]:
    return (
        f"-arch={ARCHS[Arch(arch)].nvrtc_arch}",
        "-std=c++17",
        "-DNDEBUG",
        # One ptxas option per flag: NVRTC does not split on commas.
        "--ptxas-options=-v",
    )


def options_for(arch: Arch) -> NvrtcOptions:
    return NvrtcOptions(
        flags=code_flags(arch),
        include_dirs=(include_dir(), *bundled_include_dirs()),
    )
