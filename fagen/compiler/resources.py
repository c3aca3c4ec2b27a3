"""What ptxas -v says about a kernel: registers, spills, stack, shared memory, warnings."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
# ptxas performance advisories (C75xx, e.g. C7517 "wgmma.wait_group is injected", C7510
# "wgmma serialized"): the kernel still runs but loses the overlap it was written for.
_PERFORMANCE_WARNING = re.compile(r"C75\d\d|wgmma\.wait_group|[Pp]otential [Pp]erformance [Ll]oss")


@dataclass(frozen=True)
class PtxasResources:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    static_smem: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


def parse_ptxas_log(log: str, kernel: str) -> PtxasResources:
    """Resources of entry function `kernel`; spills count every function in the log.

    A non-inlined device function spills into the caller's frame as surely as the kernel itself,
    so spills and stack are summed over all functions, registers and smem taken from the entry.
    Raises ValueError when the log has no entry for `kernel` (ptxas -v missing or wrong symbol).
    """
    blocks = _ENTRY.split(log)
    entries = {blocks[i]: blocks[i + 1] for i in range(1, len(blocks) - 1, 2)}
    if kernel not in entries:
        found = ", ".join(entries) or "none"
        raise ValueError(f"ptxas log has no entry function {kernel!r} (found: {found})")
    entry = entries[kernel]
    used = _USED.search(entry)
    smem = _SMEM.search(entry)
    frames = [tuple(map(int, m.groups())) for m in _FRAME.finditer(log)]
    return PtxasResources(
        registers=int(used.group(1)) if used else 0,
        spill_store_bytes=sum(f[1] for f in frames),
        spill_load_bytes=sum(f[2] for f in frames),
        stack_bytes=max((f[0] for f in frames), default=0),
        static_smem=int(smem.group(1)) if smem else 0,
    )


def performance_warnings(log: str) -> list[str]:
    return [line.strip() for line in log.splitlines() if _PERFORMANCE_WARNING.search(line)]
