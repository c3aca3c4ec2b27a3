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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import abi
from .._version import __version__

# 2: kernels carry max_seqlen_k (a seqlen_k bound the runtime selects by; null = unbounded) and
#    launch.ctas_per_sm (persistent grids are that many CTAs per SM).
SCHEMA_VERSION = 2
MANIFEST_NAME = "manifest.json"


class BundleError(RuntimeError):
    """A bundle that cannot be used: missing, of another version, or tampered with."""


@dataclass(frozen=True)
class Launch:
    threads: int
    block_m: int  # grid = (ceil(seqlen_q / block_m), heads_q, batch)
    dynamic_smem: int
    # TMA kernels take FagenTmaMaps as a second parameter: box rows of the Q and K/V maps
    # (64 columns, 128-byte swizzle). 0 = no TMA parameter.
    tma_q_rows: int = 0
    tma_kv_rows: int = 0
    # Persistent kernels: grid = (min(tiles, SMs x ctas_per_sm), 1, 1), tiles = query blocks x
    # heads x batch.
    persistent: bool = False
    # CTAs resident per SM the kernel was compiled for (schema 1: always 1).
    ctas_per_sm: int = 1


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int
    stack_bytes: int
    static_smem: int


@dataclass(frozen=True)
class KernelEntry:
    name: str  # == the extern "C" symbol
    key: str  # lookup key without the arch, e.g. "fwd/bf16/hd128/causal"
    arch: str  # e.g. "sm90", "sm90a"
    compute_capability: tuple[int, int]
    arch_specific: bool
    fa_version: int
    spec: dict
    cubin: str  # path relative to the bundle root
    source: str
    sha256: str
    size: int
    launch: Launch
    resources: Resources
    sass: tuple[str, ...]
    # Preferred for calls with at most this many keys (fagen.runtime.loader.select); None:
    # any length. Schema-1 manifests have no such field: every kernel unbounded.
    max_seqlen_k: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "KernelEntry":
        return cls(
            **{
                **d,
                "compute_capability": tuple(d["compute_capability"]),
                "launch": Launch(**d["launch"]),
                "resources": Resources(**d["resources"]),
                "sass": tuple(d["sass"]),
            }
        )


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


def read_manifest(bundle_dir: str | Path) -> Manifest:
    path = Path(bundle_dir) / MANIFEST_NAME
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(f"{bundle_dir}: no {MANIFEST_NAME}; is this a fagen bundle?") from None
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from None
    check_versions(d, str(path))
    try:
        return Manifest.from_dict(d)
    except (KeyError, TypeError) as exc:
        raise BundleError(f"{path}: malformed manifest ({exc})") from None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_verified_cubin(bundle_dir: str | Path, entry: KernelEntry) -> bytes:
    """The cubin's bytes, after checking size and sha256 against the manifest."""
    path = Path(bundle_dir) / entry.cubin
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{path}: cubin listed in the manifest is missing") from None
    digest = sha256_bytes(data)
    if len(data) != entry.size or digest != entry.sha256:
        raise BundleError(
            f"{path}: checksum mismatch (manifest sha256 {entry.sha256[:16]}…, file "
            f"{digest[:16]}…); the bundle was modified after it was built — refusing to load it"
        )
    return data
