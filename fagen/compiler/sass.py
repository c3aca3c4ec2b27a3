"""SASS instruction families of a cubin, read with cuobjdump or nvdisasm, from pip's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm.

A build reads the families of every kernel it compiles. One nvdisasm process costs about 0.25 s
of start-up whatever it reads (measured with NVRTC 13.5's tools), more than it then takes to
decode a kernel; cuobjdump -sass starts one per cubin. sass_families_of() therefore decodes many
cubins of one target in one nvdisasm call: their code sections, concatenated, as a raw
instruction binary (nvdisasm -b). The families equal cuobjdump -sass's for every kernel of the
default bundle; a listing that does not account for every 16-byte instruction falls back to
one cuobjdump per cubin.
"""

from __future__ import annotations

import bisect
import functools
import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .errors import ToolchainError

# "/*0080*/   @!P0 LDG.E.U16 R0, [R6.64] ;" -> "LDG"
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
# The same with the offset captured; every instruction line of nvdisasm's listing matches.
_OFFSET_INSTRUCTION = re.compile(
    r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", re.MULTILINE)
_INSTRUCTION_BYTES = 16  # every target since sm_70
LOCAL_MEMORY_FAMILIES = frozenset({"LDL", "STL"})


@functools.lru_cache(maxsize=1)
def cuobjdump_path() -> Path:
    try:
        import nvidia

        for root in nvidia.__path__:
            candidate = Path(root) / "cu13" / "bin" / "cuobjdump"
            if candidate.is_file():
                return candidate
    except ImportError:
        pass
    if found := shutil.which("cuobjdump"):
        return Path(found)
    raise ToolchainError(
        "cuobjdump not found: pip install 'nvidia-cuda-cuobjdump>=13.0,<14' "
        "'nvidia-cuda-nvdisasm>=13.0,<14' (fagen needs them to check the SASS of every kernel "
        "it builds)"
    )


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory(prefix="fagen-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        # cuobjdump -sass runs nvdisasm, which pip installs beside it (nvidia-cuda-nvdisasm).
        proc = subprocess.run(
            [str(cuobjdump_path()), "-sass", str(path)], capture_output=True, text=True,
            env=_tool_env(),
        )
    if proc.returncode != 0:
        raise ToolchainError(f"cuobjdump -sass failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def families_in(sass: str) -> frozenset[str]:
    """Opcodes without modifiers: HMMA.16816.F32.BF16 -> HMMA."""
    return frozenset(m.group(1) for line in sass.splitlines() if (m := _INSTRUCTION.match(line)))


def sass_families(cubin: bytes) -> frozenset[str]:
    return families_in(disassemble(cubin))


def sass_problems(families: frozenset[str] | set[str], required: tuple[str, ...]) -> list[str]:
    """Why these SASS families are not shippable (empty when they are)."""
    problems = []
    missing = [f for f in required if f not in families]
    if missing:
        problems.append(
            f"SASS lacks {', '.join(missing)} (the algorithm requires {', '.join(required)}): the "
            "inline PTX did not become the instructions the kernel was written for"
        )
    local = sorted(LOCAL_MEMORY_FAMILIES & set(families))
    if local:
        problems.append(
            f"SASS uses local memory ({', '.join(local)}): a register array indexed at run time "
            "or a spill; the kernel would be far slower than its tile promises"
        )
    return problems


def _tool_env() -> dict[str, str]:
    tools = cuobjdump_path().parent
    return {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}


def nvdisasm_path() -> Path | None:
    beside = cuobjdump_path().parent / "nvdisasm"
    if beside.is_file():
        return beside
    found = shutil.which("nvdisasm")
    return Path(found) if found else None


def code_sections(cubin: bytes) -> list[bytes]:
    """The executable sections (SHF_EXECINSTR) of a 64-bit little-endian ELF cubin, in section
    order. Raises ValueError for anything else."""
    if cubin[:6] != b"\x7fELF\x02\x01":
        raise ValueError("not a 64-bit little-endian ELF")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = []
    for i in range(shnum):
        _, _, flags, _, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        if flags & 0x4 and size:  # SHF_EXECINSTR
            if offset + size > len(cubin) or size % _INSTRUCTION_BYTES:
                raise ValueError(f"code section {i}: {size} bytes at {offset}")
            sections.append(cubin[offset:offset + size])
    return sections


def nvdisasm_target(nvrtc_arch: str) -> str:
    """nvdisasm's name of an NVRTC target for a raw binary: sm_90a -> SM90a."""
    if not re.fullmatch(r"sm_\d+[af]?", nvrtc_arch):
        raise ValueError(f"not a real target: {nvrtc_arch}")
    return "SM" + nvrtc_arch[3:]


def _families_raw(cubins: Sequence[bytes], nvrtc_arch: str) -> list[frozenset[str]] | None:
    """One nvdisasm over the cubins' code; None when that cannot answer for every instruction."""
    nvdisasm = nvdisasm_path()
    if nvdisasm is None:
        return None
    try:
        target = nvdisasm_target(nvrtc_arch)
        code = [b"".join(code_sections(c)) for c in cubins]
    except (ValueError, struct.error):
        return None
    starts, total = [], 0
    for part in code:
        starts.append(total)
        total += len(part)
    with tempfile.TemporaryDirectory(prefix="fagen-sass-") as tmp:
        path = Path(tmp) / "code.bin"
        path.write_bytes(b"".join(code))
        proc = subprocess.run([str(nvdisasm), "-b", target, str(path)], capture_output=True,
                              text=True, env=_tool_env())
    if proc.returncode != 0:
        return None
    families: list[set[str]] = [set() for _ in cubins]
    expected = 0
    for match in _OFFSET_INSTRUCTION.finditer(proc.stdout):
        offset = int(match.group(1), 16)
        if offset != expected:
            return None  # a gap or a repeat: not the listing this function reads
        expected += _INSTRUCTION_BYTES
        families[bisect.bisect_right(starts, offset) - 1].add(match.group(2))
    if expected != total:
        return None
    return [frozenset(f) for f in families]


def sass_families_of(cubins: Sequence[bytes], nvrtc_arch: str) -> list[frozenset[str]]:
    """sass_families() of each cubin, all built for `nvrtc_arch` (e.g. "sm_90a"): one nvdisasm
    for all of them, or one cuobjdump each where that listing does not account for all code."""
    if not cubins:
        return []
    if (found := _families_raw(cubins, nvrtc_arch)) is not None:
        return found
    return [sass_families(c) for c in cubins]
