"""The `fagen` command line: argparse subcommands, each a `cmd_<name>(args) -> exit code`.

The package is split by responsibility: `output` (the consoles, `CliError`, `fail()` and the
printing and OS-error helpers), `build` (`fagen build`), `bundles` (`fagen list`, `fagen pack`,
`fagen verify-bundle`) and `cache` (`fagen cache`); this module holds `main()` and the parser.
Add a subcommand by writing its `cmd_` function in the module of its responsibility (a new
module for a new one) and registering it in `_parser()`. Keep the imports of those modules
light: NVRTC, Jinja, pydantic-heavy modules and torch are imported inside the command that
needs them, never at start-up (`fagen cache`, `fagen list` and `--help` must not load them).

Errors: expected failures (bad spec, kernel that does not compile, unusable bundle, a path that
cannot be read or written) print a one-line `error: ...` on stderr and exit 1 (`output.fail`,
or raise `output.CliError` inside a command); a traceback means a bug in fagen.

Output: text that comes from the user or from an exception (paths, spec fields, YAML problems,
check details) is never parsed as rich markup: both consoles have markup off, and styled parts
are built as `Text`. Only fagen's own labels (`error:`, `ok`, `FAIL`) carry a style. Print
through `output.out` (looked up when printing, so a test can replace it) or output's helpers.
"""

from __future__ import annotations

import argparse
import os
import sys

from .. import paths
from .._version import __version__
from .build import cmd_build
from .bundles import cmd_list, cmd_pack, cmd_verify_bundle
from .cache import cmd_cache
from .output import fail

_ENVIRONMENT = """\
environment:
  FAGEN_HOME          build output root: `fagen build` writes $FAGEN_HOME/<bundle> and
                      `fagen list` defaults to $FAGEN_HOME/default (unset: the checkout's
                      generated/, or ~/.cache/fagen for an installed wheel)
  FAGEN_BUNDLE        the bundle (directory or packed file) that fagen.torch, `fagen bench`
                      and `fagen list` use when none is given
  FAGEN_CACHE         kernel cache: compiled cubins (kernels/) and NVRTC's headers
                      (nvrtc-headers/) (unset: ~/.cache/fagen); see `fagen cache`
  FAGEN_BUNDLE_CACHE  where packed bundles are unpacked when loaded (unset:
                      $XDG_CACHE_HOME/fagen/bundles, else ~/.cache/fagen/bundles)
  XDG_CACHE_HOME      base of the bundle cache when FAGEN_BUNDLE_CACHE is unset (the kernel
                      cache does not follow it)
  COLUMNS             output width when stdout is not a terminal (default 80)
"""

_BENCH_MISSING = (
    "fagen bench runs the benchmark of a source checkout: clone the repository and "
    "`pip install -e .`; it needs torch and a CUDA GPU"
)


def _cmd_bench(argv: list[str]) -> int:
    import importlib

    try:
        # torch is imported here, by the benchmark, never at CLI start-up.
        attention = importlib.import_module("bench.attention")
        entry = attention.main
    except (ImportError, AttributeError) as exc:
        return fail(f"{_BENCH_MISSING} (import bench.attention: {exc})")
    return entry(list(argv))


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="fagen", description="Ahead-of-time FlashAttention kernels as versioned cubin bundles.",
        epilog=_ENVIRONMENT, formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"fagen {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = commands.add_parser(
        "build", help="compile a spec file into a bundle", formatter_class=formatter,
        epilog="environment: FAGEN_HOME (output root without -o), FAGEN_CACHE (kernel cache)")
    build.add_argument("spec", nargs="?", help=f"spec YAML (default: {paths.default_spec()})")
    build.add_argument("-o", "--output", metavar="DIR",
                       help="bundle directory (default: $FAGEN_HOME or generated/, then the "
                       "bundle name from the spec)")
    build.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                       help="parallel NVRTC compiles (default: number of CPUs)")
    build.add_argument("--arch", metavar="ARCHS",
                       help="build only the spec's kernels for these targets, comma-separated (e.g. "
                       "sm90a,sm90 for a Hopper machine: a cubin runs on its own major version only, "
                       "so the rest would not load there anyway)")
    build.add_argument("-n", "--dry-run", action="store_true",
                       help="show the kernels the spec expands to (per algorithm, with tiles) and "
                       "what it skips; compile and write nothing")
    build.add_argument("-v", "--verbose", action="store_true",
                       help="print one row per kernel, not only the per-algorithm summary")
    build.set_defaults(handler=cmd_build)

    list_ = commands.add_parser(
        "list", help="show the kernels a bundle holds", formatter_class=formatter,
        epilog="environment: FAGEN_BUNDLE (the bundle without DIR), FAGEN_HOME")
    list_.add_argument("bundle", nargs="?", metavar="DIR",
                       help="bundle directory or packed file (default: $FAGEN_BUNDLE, else "
                       f"{paths.default_bundle_dir()})")
    list_.add_argument("--json", action="store_true",
                       help="machine-readable: bundle metadata and one object per kernel")
    list_.set_defaults(handler=cmd_list)

    pack = commands.add_parser("pack", help="pack a bundle directory into one file for shipping")
    pack.add_argument("bundle", metavar="DIR", help="bundle directory")
    pack.add_argument("-o", "--output", metavar="FILE",
                      help="packed file: .tar, .tar.gz/.tgz or .tar.zst (Python >= 3.14) "
                      "(default: <bundle name>.tar.gz beside DIR)")
    pack.set_defaults(handler=cmd_pack)

    verify = commands.add_parser(
        "verify-bundle", help="check a bundle (directory or packed file) without a GPU")
    verify.add_argument("path", metavar="PATH", help="bundle directory or packed file")
    verify.add_argument("--json", action="store_true",
                        help='machine-readable: {"path", "ok", "checks": [...], "bundle"}')
    verify.set_defaults(handler=cmd_verify_bundle)

    # Registered for --help only: main() hands everything after `bench` to the benchmark's own
    # parser (argparse.REMAINDER drops a leading option such as `--seqlens`).
    commands.add_parser(
        "bench", add_help=False, usage="fagen bench [ARGS...]",
        help="run the benchmark of a source checkout (bench/attention.py; needs torch and a "
        "GPU); ARGS go to it, see fagen bench --help")

    cache = commands.add_parser(
        "cache", help="show or clear the machine-local caches", formatter_class=formatter,
        epilog="environment: FAGEN_CACHE (kernel cache), FAGEN_BUNDLE_CACHE and XDG_CACHE_HOME "
        "(unpacked-bundle cache)")
    cache_commands = cache.add_subparsers(dest="cache_command", metavar="show|clear")
    cache_commands.add_parser("show", help="each cache's path, entries and size (the default)")
    clear = cache_commands.add_parser("clear", help="remove cached entries (default: --all)")
    which = clear.add_mutually_exclusive_group()
    which.add_argument("--kernels", action="store_true",
                       help="compiled kernels and NVRTC's extracted headers ($FAGEN_CACHE)")
    which.add_argument("--bundles", action="store_true",
                       help="bundles unpacked from packed files ($FAGEN_BUNDLE_CACHE)")
    which.add_argument("--all", action="store_true", help="both")
    cache.set_defaults(handler=cmd_cache)

    reference = commands.add_parser(
        "spec-reference", help="print every spec-file field and what each algorithm takes "
        "(Markdown; docs/spec-reference.md is this output)")
    reference.set_defaults(handler=_cmd_spec_reference)
    return parser


def _cmd_spec_reference(args) -> int:
    from ..model.reference import render_reference  # pydantic: only for this command

    sys.stdout.write(render_reference())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _cmd_bench(argv[1:])
    args = _parser().parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        return fail("-j/--jobs must be at least 1")
    return args.handler(args)

