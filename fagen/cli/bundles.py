"""`fagen list`, `fagen pack` and `fagen verify-bundle`: reading bundles, directories or packed."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.table import Table
from rich.text import Text

from .. import paths
from . import output
from .output import CliError, fail, is_within, print_json, print_line, print_wide, reason, smem_bytes, write_reason


def _read_any_manifest(path: Path):
    """The manifest of a bundle directory or of a packed file (read in memory, checked against
    its SHA256SUMS). Raises CliError for anything that makes it unreadable."""
    from ..bundle.format import MANIFEST_NAME, BundleError, parse_manifest, read_manifest
    from ..bundle.pack import read_packed

    try:
        if path.is_dir():
            return read_manifest(path)
        if not path.exists():
            raise CliError(f"{path}: no such bundle directory or packed file")
        return parse_manifest(read_packed(path).files[MANIFEST_NAME], f"{path} ({MANIFEST_NAME})")
    except BundleError as exc:
        raise CliError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise CliError(f"{path}: unreadable manifest ({exc})") from None
    except OSError as exc:
        raise CliError(f"cannot read {exc.filename or path}: {reason(exc)}") from None


def _tile_short(spec: dict) -> str:
    """The tile part of a kernel's name, from the spec its manifest records."""
    from ..model import KernelSpec

    if not spec.get("tile"):
        return "-"
    try:
        return KernelSpec.model_validate(spec).tile.short
    except ValueError:  # pydantic's ValidationError: a spec this fagen does not know
        return "?"


def _sorted_kernels(manifest) -> list:
    unbounded_last = 1 << 62
    return sorted(manifest.kernels, key=lambda k: (k.key, k.arch, k.max_seqlen_k or unbounded_last))


def _bundle_json(manifest, path: Path) -> dict:
    return {
        "path": str(path),
        "bundle": manifest.bundle,
        "fagen_version": manifest.fagen_version,
        "schema_version": manifest.schema_version,
        "abi_version": manifest.abi_version,
        "fingerprint": manifest.fingerprint,
        "toolchain": dict(manifest.toolchain),
        "skipped": list(manifest.skipped),  # {"entry", "fields", "why"} per skipped combination
        "kernels": [
            {"key": k.key, "arch": k.arch, "fa_version": k.fa_version,
             "tile": _tile_short(k.spec), "max_seqlen_k": k.max_seqlen_k,
             "registers": k.resources.registers, "smem": smem_bytes(k), "size": k.size,
             "name": k.name}
            for k in _sorted_kernels(manifest)
        ],
    }


def _default_bundle() -> Path:
    """What `fagen list` shows without DIR: $FAGEN_BUNDLE, else the default bundle, as
    fagen.torch.adapter.bundle_path (not imported: it needs torch)."""
    if env := os.environ.get("FAGEN_BUNDLE"):
        return Path(env)
    return paths.default_bundle_dir()


def cmd_list(args: argparse.Namespace) -> int:
    path = Path(args.bundle) if args.bundle else _default_bundle()
    try:
        manifest = _read_any_manifest(path)
    except CliError as exc:
        return fail(str(exc))
    if args.json:
        print_json(_bundle_json(manifest, path))
        return 0
    table = Table(title=Text(
        f"bundle {manifest.bundle} (fagen {manifest.fagen_version}, schema "
        f"{manifest.schema_version}, ABI {manifest.abi_version}, fingerprint "
        f"{manifest.fingerprint[:12]})"))
    for column in ("key", "arch", "fa", "tile", "seqlen_k", "regs", "smem KB", "size KB", "name"):
        table.add_column(column, justify="left" if column in ("key", "tile", "name") else "right",
                         overflow="fold")
    for k in _sorted_kernels(manifest):
        seqlen_text = "any" if k.max_seqlen_k is None else f"<= {k.max_seqlen_k}"
        table.add_row(k.key, k.arch, str(k.fa_version), _tile_short(k.spec),
                      seqlen_text, str(k.resources.registers), f"{smem_bytes(k) / 1024:.1f}",
                      f"{k.size / 1024:.1f}", k.name)
    print_wide(table)
    if manifest.skipped:
        print_line(f"{len(manifest.skipped)} combinations of the spec were skipped at build time")
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from ..bundle.format import BundleError, read_manifest
    from ..bundle.pack import pack_bundle

    bundle_dir = Path(args.bundle)
    if not bundle_dir.exists():
        return fail(f"{bundle_dir}: no such bundle directory")
    if not bundle_dir.is_dir():
        return fail(f"{bundle_dir} is a file, not a bundle directory (fagen pack packs a "
                    "directory that fagen build wrote)")
    out_file = None
    try:
        manifest = read_manifest(bundle_dir)
        # Beside the bundle, not in whatever directory the command ran from.
        out_file = Path(args.output) if args.output else bundle_dir.parent / f"{manifest.bundle}.tar.gz"
        if out_file.is_dir():
            return fail(f"{out_file} is a directory; give -o the packed file's name, e.g. "
                        f"{out_file / (manifest.bundle + '.tar.gz')}")
        pack_bundle(bundle_dir, out_file)
        size = out_file.stat().st_size
    except BundleError as exc:
        return fail(str(exc))
    except UnicodeDecodeError as exc:
        return fail(f"{bundle_dir}: unreadable manifest ({exc})")
    except OSError as exc:
        if out_file is None or (exc.filename and is_within(Path(exc.filename), bundle_dir)):
            return fail(f"cannot read the bundle {bundle_dir}: {write_reason(exc, bundle_dir)}")
        return fail(f"cannot write {out_file}: {write_reason(exc, out_file)}; choose another -o")
    print_line(
        f"packed bundle {manifest.bundle} ({len(manifest.kernels)} kernels) from {bundle_dir} "
        f"into {out_file} ({size / 1024:.1f} KB)")
    return 0


def cmd_verify_bundle(args: argparse.Namespace) -> int:
    from ..bundle.verify import verify_bundle

    path = Path(args.path)
    try:
        checks, manifest = verify_bundle(path)  # a missing path is a failed check, like the rest
    except OSError as exc:
        return fail(f"cannot read {exc.filename or path}: {reason(exc)}")
    failures = sum(not check.ok for check in checks)
    if args.json:
        print_json({
            "path": str(path), "ok": not failures,
            "checks": [{"what": c.what, "ok": c.ok, "detail": c.detail} for c in checks],
            "bundle": _bundle_json(manifest, path) if manifest is not None else None,
        })
    else:
        if manifest is not None:
            toolchain = ", ".join(f"{k} {v}" for k, v in sorted(manifest.toolchain.items()))
            output.out.print(Text(f"bundle {manifest.bundle}: built by fagen {manifest.fagen_version} "
                                  f"({toolchain}), fingerprint {manifest.fingerprint[:12]}"),
                             soft_wrap=True)
        for check in checks:
            mark = ("ok  ", "green") if check.ok else ("FAIL", "bold red")
            output.out.print(Text.assemble(mark, f" {check.what}: ", check.detail), soft_wrap=True)
    if failures:
        return fail(f"{path}: {failures} of {len(checks)} checks failed; do not ship or "
                    "load this bundle")
    if not args.json:
        print_line(f"{path}: all {len(checks)} checks passed")
    return 0
