"""Output of the `fagen` commands: the two consoles, the `error:` line, and text helpers.

Both consoles have markup off; styled parts are built as `Text` (see fagen.cli). Commands
print through `out` as `output.out` (looked up at each call), so a test can replace it.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

# Width: the terminal's, else $COLUMNS, else 80 (rich's rule). Tables of kernel names (`fagen
# list`, `fagen build -v`) are printed at their natural width when piped (see print_wide).
out = Console(markup=False, highlight=False)
err = Console(stderr=True, markup=False, highlight=False)


class CliError(Exception):
    """An expected failure inside a command: its message becomes the `error:` line."""


def fail(message: str, detail: str = "") -> int:
    err.print(Text.assemble(("error:", "bold red"), " ", str(message)), soft_wrap=True)
    if detail:
        err.print(Text(detail), soft_wrap=True)
    return 1


# ---- printing ----

def print_line(*parts: str | tuple[str, str], wrap: bool = True) -> None:
    """One line of stdout, never parsed as markup; wrapped to the console width, or with
    wrap=False left whole (paths to copy)."""
    out.print(Text.assemble(*parts), soft_wrap=not wrap)


def print_wide(table: Table) -> None:
    """A table with kernel names: folded to fit a terminal or $COLUMNS; at its natural width
    when piped without $COLUMNS, so a log or grep sees whole names."""
    console = out
    if not out.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        natural = Measurement.get(out, out.options.update_width(1 << 14), table).maximum
        if natural > out.width:
            console = Console(file=out.file, width=natural, markup=False, highlight=False)
    console.print(table)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=1) + "\n")
    sys.stdout.flush()


# ---- OS errors ----

def reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a link loop
        return path.absolute()


def is_within(path: Path, root: Path) -> bool:
    try:
        resolved(path).relative_to(resolved(root))
    except ValueError:
        return False
    return True


def non_directory_ancestor(path: Path) -> Path | None:
    """The first existing ancestor of `path` (from the root down) that is not a directory."""
    for ancestor in reversed(path.parents):
        if ancestor.exists() and not ancestor.is_dir():
            return ancestor
    return None


def write_reason(exc: OSError, target: Path) -> str:
    """Why writing `target` failed: a file where a directory should be, or the OS's reason and
    the path it refused when that is not `target` itself (a lock or temporary file beside it)."""
    if exc.errno in (errno.EEXIST, errno.ENOTDIR) and (blocker := non_directory_ancestor(target)):
        return f"{blocker} is a file, not a directory"
    text = reason(exc)
    if exc.filename and resolved(Path(os.fsdecode(exc.filename))) != resolved(target):
        text += f" ({exc.filename})"
    return text


# ---- sizes and counts ----

def size_text(size: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def count_text(count: int, unit: str) -> str:
    return f"{count} {unit}{'' if count == 1 else 's'}"


def smem_bytes(entry) -> int:
    """A manifest entry's shared memory per CTA: dynamic (its launch) plus static."""
    return entry.launch.dynamic_smem + entry.resources.static_smem
