"""The bundle format: manifest model, version rules and integrity checks.

Standard library only (no pydantic, no NVRTC): the runtime reads bundles with this module on
machines that have neither. The writer (fagen.bundle.writer) produces the same model, and the
generated C index is emitted from it, so JSON and C cannot diverge.

Version rules:
- ``schema_version`` (layout of manifest.json): a reader accepts any version up to its own and
  refuses a newer one, naming both.
- ``abi_version`` (layout of params.h, fagen.abi): must equal the reader's exactly; the kernels
  would read garbage parameters otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import abi, contract
from ..contract import KernelEntry
from .._version import __version__

# 2: kernels carry max_seqlen_k (a seqlen_k bound the runtime selects by; null = unbounded) and
#    launch.ctas_per_sm (persistent grids are that many CTAs per SM).
# 3: launch.grid names the grid's shape (replacing launch.persistent and launch.ctas_per_sm);
#    launch.workspace_floats_per_row (a kernel's fp32 workspace); include/fagen/contract.h.
# 4: backward kernels (key "bwd/...", one cubin with three entry points): launch.grid
#    "key_blocks" and launch.block_n (index.h rows gain block_n).
# 5: TMA backward kernels (the FA3 backward: launch.tma_q_rows > 0 on a "bwd/..." key), whose
#    main kernel takes FagenBwdTmaMaps.
SCHEMA_VERSION = 5
MANIFEST_NAME = "manifest.json"


class BundleError(RuntimeError):
    """A bundle that cannot be used: missing, of another version, or tampered with."""


@dataclass(frozen=True)
class Manifest:
    bundle: str
    fingerprint: str
    toolchain: dict
    kernels: tuple[KernelEntry, ...]
    schema_version: int = SCHEMA_VERSION
    abi_version: int = abi.ABI_VERSION
    fagen_version: str = __version__
    skipped: tuple[dict, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        return cls(
            **{
                **d,
                "kernels": tuple(KernelEntry.from_dict(k) for k in d["kernels"]),
                "toolchain": dict(d["toolchain"]),
                "skipped": tuple(d.get("skipped", ())),
            }
        )


def check_versions(d: dict, where: str) -> None:
    schema = d.get("schema_version")
    if not isinstance(schema, int):
        raise BundleError(f"{where}: not a fagen manifest (no schema_version)")
    if schema > SCHEMA_VERSION:
        raise BundleError(
            f"{where}: manifest schema_version {schema} is newer than this fagen "
            f"({__version__}) reads (up to {SCHEMA_VERSION}); upgrade fagen or rebuild the bundle"
        )
    if d.get("abi_version") != abi.ABI_VERSION:
        raise BundleError(
            f"{where}: bundle was built for kernel ABI version {d.get('abi_version')}, this fagen "
            f"({__version__}) speaks ABI version {abi.ABI_VERSION}; rebuild the bundle with this "
            "fagen (fagen build ...)"
        )


def check_paths(manifest: Manifest, where: str) -> None:
    """Refuse a manifest that names a file outside its bundle (contract.path_problem); the
    message names the field and the path, and nothing about what the path points to."""
    for index, entry in enumerate(manifest.kernels):
        for field_name in ("cubin", "source"):
            value = getattr(entry, field_name)
            if problem := contract.path_problem(value):
                raise BundleError(
                    f"{where}: kernels[{index}].{field_name} {value!r}: {problem} (a manifest names "
                    "files inside its bundle only); refusing the bundle")


def parse_manifest(text: str | bytes, where: str) -> Manifest:
    """A manifest from its JSON text: versions, fields and paths checked."""
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise BundleError(f"{where}: not a fagen manifest (no schema_version)")
    check_versions(d, where)
    try:
        manifest = Manifest.from_dict(d)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(f"{where}: malformed manifest ({exc})") from None
    check_paths(manifest, where)
    return manifest


def _read_manifest_bytes(bundle_dir: Path) -> bytes:
    try:
        return (bundle_dir / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{bundle_dir}: no {MANIFEST_NAME}; is this a fagen bundle?") from None
    except (IsADirectoryError, NotADirectoryError):
        raise BundleError(f"{bundle_dir}: not a bundle directory (no {MANIFEST_NAME} file)") from None


def read_manifest(bundle_dir: str | Path) -> Manifest:
    bundle_dir = Path(bundle_dir)
    return parse_manifest(_read_manifest_bytes(bundle_dir), str(bundle_dir / MANIFEST_NAME))


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _inside(bundle_dir: Path, relative: str) -> Path:
    """bundle_dir / relative, refused when links make it resolve outside the bundle."""
    path = bundle_dir / relative
    root = os.path.realpath(bundle_dir)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise BundleError(f"{path}: resolves outside the bundle (through a link); refusing it")
    return path


def read_verified_cubin(bundle_dir: str | Path, entry: KernelEntry) -> bytes:
    """The cubin's bytes, after checking size and sha256 against the manifest."""
    path = _inside(Path(bundle_dir), entry.cubin)
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise BundleError(f"{path}: cubin listed in the manifest is missing") from None
    digest = sha256_bytes(data)
    if len(data) != entry.size or digest != entry.sha256:
        raise BundleError(
            f"{path}: checksum mismatch (manifest sha256 {entry.sha256[:16]}…, file "
            f"{digest[:16]}…); the bundle was modified after it was built — refusing to load it"
        )
    return data


# Opening a bundle while `fagen build` replaces it: the manifest and the cubins may come from
# two builds. Each try that finds a cubin not matching the manifest re-reads the manifest; a
# changed one means the bundle was swapped meanwhile, and the open starts over.
_OPEN_TRIES = 3


def read_bundle(bundle_dir: str | Path) -> tuple[Manifest, dict[str, bytes]]:
    """The manifest and every cubin of the bundle, each verified against the manifest: one
    consistent snapshot, after which the bundle's files are never read again (a rebuild of the
    directory cannot reach a process that opened it). Raises BundleError for a missing or
    tampered cubin, naming it."""
    bundle_dir = Path(bundle_dir)
    where = str(bundle_dir / MANIFEST_NAME)
    for _ in range(_OPEN_TRIES):
        text = _read_manifest_bytes(bundle_dir)
        manifest = parse_manifest(text, where)
        try:
            return manifest, {e.name: read_verified_cubin(bundle_dir, e) for e in manifest.kernels}
        except BundleError:
            try:
                unchanged = _read_manifest_bytes(bundle_dir) == text
            except BundleError:
                unchanged = False
            if unchanged:
                raise
    raise BundleError(f"{bundle_dir}: the bundle changed on disk while it was being opened "
                      f"({_OPEN_TRIES} tries); open it again once the rebuild has finished")
