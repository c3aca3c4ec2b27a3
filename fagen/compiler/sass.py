"""SASS instruction families of a cubin, read with cuobjdump (pip nvidia-cuda-cuobjdump)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import ToolchainError

# "/*0080*/   @!P0 LDG.E.U16 R0, [R6.64] ;" -> "LDG"
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
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
        tools = cuobjdump_path().parent
        env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
        proc = subprocess.run(
            [str(cuobjdump_path()), "-sass", str(path)], capture_output=True, text=True, env=env
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
