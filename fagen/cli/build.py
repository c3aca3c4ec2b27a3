"""`fagen build`: compile a spec into a bundle, or with --dry-run show what it expands to."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .. import paths
from .._version import __version__
from . import output
from .output import count_text, fail, is_within, print_line, print_wide, reason, smem_bytes, write_reason


def _build_os_error(exc: OSError, out_dir: Path) -> str:
    if exc.errno is None:
        return str(exc)  # fagen's own (e.g. "exists and is not a fagen bundle"), already phrased
    filename = Path(os.fsdecode(exc.filename)) if exc.filename else None
    cache = paths.cache_root()
    if filename is not None and not is_within(filename, out_dir.parent) and is_within(filename, cache):
        return (f"cannot write the kernel cache {cache}: {reason(exc)} ({filename}); set "
                "FAGEN_CACHE to a writable directory")
    if filename is not None and not is_within(filename, out_dir.parent):
        return f"{filename}: {reason(exc)}"
    return f"cannot write the bundle to {out_dir}: {write_reason(exc, out_dir)}; choose another -o"


def _skip_line(entry: int, fields: dict, why: str) -> str:
    text = ", ".join(f"{key}={value}" for key, value in fields.items())
    return f"skipped kernels[{entry}] ({text}): {why}"


def _algorithm_label(fa_version: int, direction: str, arch: str) -> str:
    return f"fa{fa_version} {arch}" if direction == "fwd" else f"fa{fa_version} {direction} {arch}"


def _keep_archs(expansion, archs_text: str) -> str | None:
    """Restricts `expansion` to the kernels of the targets `archs_text` names; why not, or None."""
    from ..model import ARCHS

    wanted = [a.strip() for a in archs_text.split(",") if a.strip()]
    known = {arch.value for arch in ARCHS}
    if unknown := [a for a in wanted if a not in known]:
        return f"--arch {archs_text}: {', '.join(unknown)} not a target (one of {', '.join(sorted(known))})"
    kept = [spec for spec in expansion.specs if spec.arch.value in wanted]
    if not kept:
        present = sorted({spec.arch.value for spec in expansion.specs})
        return f"--arch {archs_text}: the spec has no kernel for it (its targets: {', '.join(present)})"
    expansion.specs = kept
    return None


def cmd_build(args: argparse.Namespace) -> int:
    from ..model import SpecError, load_spec_file

    spec_path = Path(args.spec) if args.spec else paths.default_spec()
    try:
        expansion = load_spec_file(spec_path)
    except SpecError as exc:
        return fail(str(exc))
    if args.arch:
        problem = _keep_archs(expansion, args.arch)
        if problem:
            return fail(problem)
    out_dir = Path(args.output) if args.output else paths.generated_dir() / expansion.bundle
    if args.dry_run:
        return _dry_run(expansion, spec_path, out_dir)

    # Imported here: `fagen list`, `fagen cache` and --dry-run must not need NVRTC or Jinja.
    try:
        from ..build import KernelBuild, build_bundle
        from ..codegen import RenderError
        from ..compiler import CompileError, ToolchainError
    except ImportError as exc:
        if not (exc.name or "").startswith(("cuda", "nvidia")):
            raise  # fagen's own import is broken: a bug, not the user's environment
        return fail(f"fagen build needs NVRTC (pip packages cuda-bindings and nvidia-cuda-nvrtc): {exc}")

    print_line(f"fagen {__version__}: building bundle ", (expansion.bundle, "bold"),
               f" ({len(expansion.specs)} kernels) from {spec_path} into {out_dir} with "
               f"{args.jobs} jobs")
    out = output.out
    progress = Progress(
        TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}", markup=False), console=out, transient=True,
        disable=not out.is_terminal,  # a log gets the summary, not a blank line
    )
    try:
        with progress:
            task = progress.add_task("", total=len(expansion.specs))

            def advance(kernel: KernelBuild, done: int, total: int) -> None:
                progress.update(task, completed=done, description=kernel.name)

            report = build_bundle(expansion, out_dir, jobs=args.jobs, progress=advance)
    except KeyboardInterrupt:
        fail(f"interrupted: {out_dir} left as it was (the kernels compiled so far are cached)")
        return 130  # the shell's code for a command ended by SIGINT
    except CompileError as exc:
        detail = exc.log_excerpt()
        return fail(str(exc), f"--- NVRTC/ptxas log ---\n{detail}" if detail else "")
    except (RenderError, ToolchainError) as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(_build_os_error(exc, out_dir))

    if args.verbose:
        print_wide(_kernel_table(report))
    out.print(_summary_table(report))
    for skip in report.skipped:
        print_line(_skip_line(skip["entry"], skip["fields"], skip["why"]))
    print_line(
        f"{len(report.kernels)} kernels ({report.compiled} compiled, "
        f"{len(report.kernels) - report.compiled} cached), {len(report.skipped)} skipped, "
        f"{report.seconds:.1f} s" + ("" if args.verbose else "; -v lists each kernel"))
    return 0


def _summary_table(report) -> Table:
    """One row per algorithm and arch: counts and the largest resources (fits 80 columns)."""
    entries = {k.name: k for k in report.manifest.kernels}
    groups: dict[tuple, list] = {}
    for k in report.kernels:
        entry = entries[k.name]
        key = (entry.fa_version, entry.spec.get("direction", "fwd"), entry.arch)
        groups.setdefault(key, []).append((k, entry))
    table = Table(title=Text(f"bundle {report.manifest.bundle}: {report.bundle_dir}"))
    table.add_column("algorithm", justify="left", no_wrap=True)
    # Short headers: the widest algorithm label ("fa2 bwd sm90") and six columns fit 80.
    for column in ("kernels", "compiled", "cached", "regs", "smem KB", "cubin KB"):
        table.add_column(column, justify="right")
    for (fa_version, direction, arch), members in sorted(groups.items()):
        cached = sum(k.cached for k, _ in members)
        table.add_row(
            _algorithm_label(fa_version, direction, arch), str(len(members)),
            str(len(members) - cached), str(cached),
            str(max(k.resources.registers for k, _ in members)),
            f"{max(smem_bytes(e) for _, e in members) / 1024:.1f}",
            f"{sum(k.cubin_size for k, _ in members) / 1024:.1f}",
        )
    return table


def _kernel_table(report) -> Table:
    table = Table(title=Text(f"bundle {report.manifest.bundle}: {report.bundle_dir}"))
    table.add_column("kernel", justify="left", overflow="fold")
    for column in ("arch", "regs", "spills", "smem KB", "cubin KB", "compile s", "cached"):
        table.add_column(column, justify="right", no_wrap=True)
    entries = {k.name: k for k in report.manifest.kernels}
    for k in report.kernels:
        smem = (entries[k.name].launch.dynamic_smem + k.resources.static_smem) / 1024
        table.add_row(k.name, k.arch, str(k.resources.registers), str(k.resources.spill_bytes),
                      f"{smem:.1f}", f"{k.cubin_size / 1024:.1f}", f"{k.seconds:.2f}",
                      "yes" if k.cached else "no")
    return table


def _dry_run(expansion, spec_path: Path, out_dir: Path) -> int:
    groups: dict[tuple, list] = {}
    for spec in expansion.specs:
        groups.setdefault((spec.fa_version, spec.direction, spec.arch.value), []).append(spec)
    print_line(
        f"fagen {__version__}: {spec_path} expands to bundle ", (expansion.bundle, "bold"),
        f": {count_text(len(expansion.specs), 'kernel')} in "
        f"{count_text(len(groups), 'algorithm/arch group')}, "
        f"{count_text(len(expansion.skipped), 'combination')} skipped (dry run: nothing compiled or written; "
        f"the bundle would go to {out_dir})")
    for (fa_version, direction, arch), specs in sorted(groups.items()):
        label = _algorithm_label(fa_version, direction, arch)
        print_line((f"{label}: {count_text(len(specs), 'kernel')}", "bold"))
        for spec in specs:
            bound = "any seqlen_k" if spec.max_seqlen_k is None else f"seqlen_k <= {spec.max_seqlen_k}"
            # Not wrapped: one kernel per line, whole names for grep.
            output.out.print(Text(f"  {spec.name}  (tile {spec.tile.short}, {bound})"), soft_wrap=True)
    for entry, fields, why in expansion.skipped:
        print_line(_skip_line(entry, fields, why))
    return 0
