"""The `fagen` command line: argparse subcommands, each a `_cmd_<name>(args) -> exit code`.

Add a subcommand by writing its `_cmd_` function and registering it in `_parser()`. Expected
failures (bad spec, kernel that does not compile, unusable bundle) print a message and exit 1;
a traceback means a bug in fagen.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import paths
from ._version import __version__

# Piped output (CI logs, `| less`) gets no terminal width; kernel names are long, so give
# tables room rather than truncating them to rich's 80-column default.
_out = Console(width=None if sys.stdout.isatty() else 200)
_err = Console(stderr=True)


def _fail(message: str, detail: str = "") -> int:
    _err.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    if detail:
        _err.print(detail, markup=False, highlight=False, soft_wrap=True)
    return 1


def _cmd_build(args: argparse.Namespace) -> int:
    # Imported here: `fagen list` and future runtime-side commands must not need NVRTC or Jinja.
    from .bundle.writer import KernelBuild, build_bundle
    from .codegen import RenderError
    from .compiler import CompileError, ToolchainError
    from .spec import SpecError, load_spec_file

    spec_path = Path(args.spec) if args.spec else paths.default_spec()
    try:
        expansion = load_spec_file(spec_path)
    except SpecError as exc:
        return _fail(str(exc))
    out_dir = Path(args.output) if args.output else paths.generated_dir() / expansion.bundle
    _out.print(
        f"fagen {__version__}: building bundle [bold]{expansion.bundle}[/] "
        f"({len(expansion.specs)} kernels) from {spec_path} into {out_dir} with {args.jobs} jobs",
        highlight=False,
    )
    progress = Progress(
        TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}"), console=_out, transient=True,
    )
    try:
        with progress:
            task = progress.add_task("", total=len(expansion.specs))

            def advance(kernel: KernelBuild, done: int, total: int) -> None:
                progress.update(task, completed=done, description=kernel.name)

            report = build_bundle(expansion, out_dir, jobs=args.jobs, progress=advance)
    except CompileError as exc:
        detail = exc.log_excerpt()
        return _fail(str(exc), f"--- NVRTC/ptxas log ---\n{detail}" if detail else "")
    except (RenderError, ToolchainError, FileExistsError) as exc:
        return _fail(str(exc))

    table = Table(title=f"bundle {report.manifest.bundle}: {report.bundle_dir}")
    table.add_column("kernel", justify="left", overflow="fold")
    for column in ("arch", "regs", "spills", "smem KB", "cubin KB", "compile s", "cached"):
        table.add_column(column, justify="right", no_wrap=True)
    dynamic_smem = {k.name: k.launch.dynamic_smem for k in report.manifest.kernels}
    for k in report.kernels:
        smem = (dynamic_smem[k.name] + k.resources.static_smem) / 1024
        table.add_row(k.name, k.arch, str(k.resources.registers), str(k.resources.spill_bytes),
                      f"{smem:.1f}", f"{k.cubin_size / 1024:.1f}", f"{k.seconds:.2f}",
                      "yes" if k.cached else "no")
    _out.print(table)
    for skip in report.skipped:
        fields = ", ".join(f"{key}={value}" for key, value in skip["fields"].items())
        _out.print(f"skipped kernels[{skip['entry']}] ({fields}): {skip['why']}", highlight=False)
    _out.print(
        f"{len(report.kernels)} kernels ({report.compiled} compiled, "
        f"{len(report.kernels) - report.compiled} cached), {len(report.skipped)} skipped, "
        f"{report.seconds:.1f} s",
        highlight=False,
    )
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from .bundle.format import BundleError, read_manifest
    from .spec import TileConfig

    bundle_dir = Path(args.bundle) if args.bundle else paths.default_bundle_dir()
    try:
        manifest = read_manifest(bundle_dir)
    except BundleError as exc:
        return _fail(str(exc))
    table = Table(
        title=f"bundle {manifest.bundle} (fagen {manifest.fagen_version}, schema "
        f"{manifest.schema_version}, ABI {manifest.abi_version}, fingerprint "
        f"{manifest.fingerprint[:12]})"
    )
    for column in ("key", "arch", "fa", "tile", "seqlen_k", "regs", "smem KB", "size KB", "name"):
        table.add_column(column, justify="left" if column in ("key", "tile", "name") else "right")
    unbounded_last = 1 << 62
    for k in sorted(manifest.kernels, key=lambda k: (k.key, k.arch, k.max_seqlen_k or unbounded_last)):
        tile = k.spec.get("tile")
        tile_text = TileConfig.model_validate(tile).short if tile else "-"
        smem = (k.launch.dynamic_smem + k.resources.static_smem) / 1024
        seqlen_text = "any" if k.max_seqlen_k is None else f"<= {k.max_seqlen_k}"
        table.add_row(k.key, k.arch, str(k.fa_version), tile_text, seqlen_text, str(k.resources.registers),
                      f"{smem:.1f}", f"{k.size / 1024:.1f}", k.name)
    _out.print(table)
    if manifest.skipped:
        _out.print(f"{len(manifest.skipped)} combinations of the spec were skipped at build time")
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    from .bundle.format import BundleError, read_manifest
    from .bundle.pack import pack_bundle

    bundle_dir = Path(args.bundle)
    try:
        manifest = read_manifest(bundle_dir)
        out_file = Path(args.output) if args.output else Path(f"{manifest.bundle}.tar.gz")
        pack_bundle(bundle_dir, out_file)
    except BundleError as exc:
        return _fail(str(exc))
    _out.print(
        f"packed bundle {manifest.bundle} ({len(manifest.kernels)} kernels) from {bundle_dir} "
        f"into {out_file} ({out_file.stat().st_size / 1024:.1f} KB)",
        highlight=False,
    )
    return 0


def _cmd_verify_bundle(args: argparse.Namespace) -> int:
    from .bundle.verify import verify_bundle

    checks, manifest = verify_bundle(args.path)
    if manifest is not None:
        toolchain = ", ".join(f"{k} {v}" for k, v in sorted(manifest.toolchain.items()))
        _out.print(
            f"bundle {manifest.bundle}: built by fagen {manifest.fagen_version} ({toolchain}), "
            f"fingerprint {manifest.fingerprint[:12]}",
            highlight=False, soft_wrap=True,
        )
    for check in checks:
        mark = "[green]ok  [/]" if check.ok else "[bold red]FAIL[/]"
        _out.print(f"{mark} {check.what}: ", end="", markup=True, highlight=False)
        _out.print(check.detail, markup=False, highlight=False, soft_wrap=True)
    failures = sum(not check.ok for check in checks)
    if failures:
        return _fail(f"{args.path}: {failures} of {len(checks)} checks failed; do not ship or "
                     "load this bundle")
    _out.print(f"{args.path}: all {len(checks)} checks passed", highlight=False)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fagen", description="Ahead-of-time FlashAttention kernels as versioned cubin bundles."
    )
    parser.add_argument("--version", action="version", version=f"fagen {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = commands.add_parser("build", help="compile a spec file into a bundle")
    build.add_argument("spec", nargs="?", help=f"spec YAML (default: {paths.default_spec()})")
    build.add_argument("-o", "--output", metavar="DIR",
                       help="bundle directory (default: generated/<bundle name from the spec>)")
    build.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                       help="parallel NVRTC compiles (default: number of CPUs)")
    build.set_defaults(handler=_cmd_build)

    list_ = commands.add_parser("list", help="show the kernels a bundle holds")
    list_.add_argument("bundle", nargs="?", metavar="DIR",
                       help=f"bundle directory (default: {paths.default_bundle_dir()})")
    list_.set_defaults(handler=_cmd_list)

    pack = commands.add_parser("pack", help="pack a bundle directory into one file for shipping")
    pack.add_argument("bundle", metavar="DIR", help="bundle directory")
    pack.add_argument("-o", "--output", metavar="FILE",
                      help="packed file: .tar, .tar.gz/.tgz or .tar.zst (Python >= 3.14) "
                      "(default: <bundle name>.tar.gz)")
    pack.set_defaults(handler=_cmd_pack)

    verify = commands.add_parser(
        "verify-bundle", help="check a bundle (directory or packed file) without a GPU")
    verify.add_argument("path", metavar="PATH", help="bundle directory or packed file")
    verify.set_defaults(handler=_cmd_verify_bundle)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        return _fail("-j/--jobs must be at least 1")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
