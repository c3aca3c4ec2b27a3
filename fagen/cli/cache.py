"""`fagen cache`: show or clear the kernel cache, NVRTC's headers and the unpacked-bundle cache."""

from __future__ import annotations

import argparse
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from .. import paths
from .output import count_text, fail, print_line, reason, size_text

_HEX64 = re.compile(r"^\.?[0-9a-f]{64}(\..*)?$")
_KERNEL_ENTRY = re.compile(r"^\.?[0-9a-f]{64}\.(cubin|json)(\..*)?$")  # with _write_atomic's temps
_SHARD = re.compile(r"^[0-9a-f]{2}$")


def _tree_size(files: Iterable[Path]) -> int:
    total = 0
    for f in files:
        try:
            total += f.lstat().st_size
        except OSError:
            pass
    return total


def _files_under(root: Path) -> list[Path]:
    try:
        return [p for p in root.rglob("*") if p.is_file() or p.is_symlink()]
    except OSError:
        return []


def _kernel_entries(root: Path) -> list[Path]:
    """The cache's own files under kernels/: <key[:2]>/<key>.cubin and .json."""
    if not root.is_dir():
        return []
    return [p for p in root.glob("??/*")
            if _SHARD.match(p.parent.name) and _KERNEL_ENTRY.match(p.name) and p.is_file()]


def _bundle_entries(root: Path) -> list[Path]:
    """Entries of the unpacked-bundle cache: directories named by a packed file's sha256 (and
    their staging directories); nothing else under the directory is fagen's."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _HEX64.match(p.name))


def _caches() -> list[dict]:
    from ..bundle.pack import cache_dir

    kernels = paths.cache_root() / "kernels"
    headers = paths.cache_root() / "nvrtc-headers"
    bundles = cache_dir()
    kernel_files = _kernel_entries(kernels)
    bundle_entries = _bundle_entries(bundles)
    header_versions = sorted(p for p in headers.iterdir() if p.is_dir()) if headers.is_dir() else []
    bundle_files = [f for e in bundle_entries for f in ([e] if e.is_file() else _files_under(e))]
    return [
        {"what": "kernels", "label": "kernel cache", "path": kernels, "env": "FAGEN_CACHE",
         "count": sum(p.name.endswith(".cubin") and not p.name.startswith(".") for p in kernel_files), "unit": "kernel",
         "size": _tree_size(kernel_files), "remove": kernel_files},
        {"what": "kernels", "label": "NVRTC headers", "path": headers, "env": "FAGEN_CACHE",
         "count": len(header_versions), "unit": "NVRTC version",
         "size": _tree_size(_files_under(headers)), "remove": [headers] if headers.is_dir() else []},
        {"what": "bundles", "label": "bundle cache", "path": bundles,
         "env": "FAGEN_BUNDLE_CACHE or $XDG_CACHE_HOME", "count": len(bundle_entries),
         "unit": "unpacked bundle", "size": _tree_size(bundle_files), "remove": bundle_entries},
    ]


def cmd_cache(args: argparse.Namespace) -> int:
    caches = _caches()
    if args.cache_command in (None, "show"):
        for c in caches:
            print_line((f"{c['label']}:", "bold"), f" {c['path']}", wrap=False)
            print_line(f"  {count_text(c['count'], c['unit'])}, {size_text(c['size'])} "
                       f"(set by ${c['env']})")
        print_line("remove them with: fagen cache clear [--kernels|--bundles|--all]")
        return 0
    chosen = {"kernels"} if args.kernels else {"bundles"} if args.bundles else {"kernels", "bundles"}
    problems = []
    for c in (c for c in caches if c["what"] in chosen):
        if not c["remove"]:
            print_line(f"{c['label']} {c['path']}: empty, nothing to remove", wrap=False)
            continue
        for target in c["remove"]:
            try:
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                problems.append(f"cannot remove {exc.filename or target}: {reason(exc)}")
        if c["what"] == "kernels" and c["path"].name == "kernels":
            for shard in (p for p in c["path"].glob("??") if _SHARD.match(p.name) and p.is_dir()):
                try:
                    shard.rmdir()  # only empty shards: anything else there is not the cache's
                except OSError:
                    pass
        print_line(f"removed {c['label']} {c['path']}: {count_text(c['count'], c['unit'])}, "
                   f"{size_text(c['size'])}", wrap=False)
    if problems:
        return fail(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return 0
