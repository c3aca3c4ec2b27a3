"""Summary of an Nsight Compute source page (SASS with per-instruction counters), as exported by

    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > sass.csv

Prints the executed warp instructions by opcode, the warp-stall samples by reason, and the
instructions with the most stall samples: enough to compare two builds of a kernel (which one
executes fewer instructions, and where each one waits) without the Nsight GUI.

    python -m bench.source_counters sass.csv [more.csv ...] [--top 20]
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter

_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def _opcode(source: str) -> str:
    text = _PREDICATE.sub("", source.strip())
    return text.split()[0].split(".")[0] if text else "?"


def summarize(path: str, top: int) -> str:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[1]  # rows[0] names the kernel
    column = {name: i for i, name in enumerate(header)}
    stall_columns = [h for h in header if h.startswith("stall_") and "(Not" not in h]
    mix, stalls, hot = Counter(), Counter(), []
    executed_total = samples_total = 0
    for row in rows[2:]:
        if len(row) < len(header):
            continue
        source = row[column["Source"]].strip()
        executed = int(row[column["Instructions Executed"]] or 0)
        samples = int(row[column["# Samples"]] or 0)
        mix[_opcode(source)] += executed
        executed_total += executed
        samples_total += samples
        by_reason = {c[len("stall_"):]: int(row[column[c]] or 0) for c in stall_columns}
        stalls.update(by_reason)
        hot.append((samples, executed, source, by_reason))
    lines = [f"{path}: {rows[0][1] if len(rows[0]) > 1 else ''}",
             f"  executed warp instructions {executed_total / 1e6:.2f} M; by opcode (M):",
             "    " + ", ".join(f"{op} {n / 1e6:.2f}" for op, n in mix.most_common(24)),
             f"  stall samples {samples_total}; by reason:",
             "    " + ", ".join(f"{r} {100 * n / max(samples_total, 1):.1f}%"
                               for r, n in stalls.most_common(12) if n)]
    lines.append(f"  top {top} instructions by samples (samples, executed, source, main reasons):")
    for samples, executed, source, by_reason in sorted(hot, key=lambda h: -h[0])[:top]:
        reasons = ", ".join(f"{r}:{n}" for r, n in sorted(by_reason.items(), key=lambda kv: -kv[1])[:3] if n)
        lines.append(f"    {samples:6d} {executed:9d}  {source[:58]:58s} {reasons}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    print("\n\n".join(summarize(path, args.top) for path in args.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
