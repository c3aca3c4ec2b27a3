"""`fagen verify-bundle`: check a bundle directory or packed file without a GPU.

Checks the manifest's schema and ABI versions against this fagen, its paths (inside the bundle),
every cubin's size and sha256 against the manifest, that include/fagen/index.h is exactly what
this manifest generates (so the C++ loader and the Python loader see the same kernels), that
include/fagen/contract.h is this fagen's contract, that include/fagen/params.h declares the
manifest's ABI version and, for a packed file, every member against SHA256SUMS. Standard library
only, like the rest of the runtime path.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import abi
from .contract_header import CONTRACT_HEADER, render_contract_header
from .cindex import INDEX_HEADER, PARAMS_HEADER, manifest_sha256, render_index_header
from .format import (
    MANIFEST_NAME, SCHEMA_VERSION, BundleError, Manifest, check_versions, parse_manifest,
    sha256_bytes,
)
from .pack import read_packed

_ABI_DEFINE = re.compile(r"^#define FAGEN_ABI_VERSION (\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Check:
    what: str
    ok: bool
    detail: str = ""


def _first_difference(expected: str, actual: str) -> str:
    for number, (want, got) in enumerate(zip(expected.splitlines(), actual.splitlines()), 1):
        if want != got:
            return f"line {number}: expected {want!r}, found {got!r}"
    return "the files differ in length"


def _check_manifest(read: Callable[[str], bytes | None], where: str) -> tuple[list[Check], Manifest | None]:
    text = read(MANIFEST_NAME)
    if text is None:
        return [Check(MANIFEST_NAME, False, f"{where}: no {MANIFEST_NAME}; is this a fagen bundle?")], None
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return [Check(MANIFEST_NAME, False, f"not valid JSON ({exc})")], None
    if not isinstance(d, dict):
        return [Check(MANIFEST_NAME, False, "not a fagen manifest (no schema_version)")], None
    versions = (
        f"schema_version {d.get('schema_version')} (this fagen reads up to {SCHEMA_VERSION}), "
        f"abi_version {d.get('abi_version')} (this fagen speaks {abi.ABI_VERSION})"
    )
    try:
        check_versions(d, where)
    except BundleError as exc:
        return [Check("versions", False, str(exc))], None
    try:
        manifest = parse_manifest(text, where)
    except BundleError as exc:
        return [Check("versions", True, versions), Check(MANIFEST_NAME, False, str(exc))], None
    return [Check("versions", True, versions)], manifest


def _check_cubins(read: Callable[[str], bytes | None], manifest: Manifest) -> list[Check]:
    checks = []
    for entry in manifest.kernels:
        data = read(entry.cubin)
        if data is None:
            checks.append(Check(entry.cubin, False, "listed in the manifest but missing"))
            continue
        digest = sha256_bytes(data)
        if len(data) != entry.size or digest != entry.sha256:
            checks.append(Check(entry.cubin, False,
                                f"manifest says {entry.size} bytes, sha256 {entry.sha256[:16]}…; "
                                f"file has {len(data)} bytes, sha256 {digest[:16]}…"))
        else:
            checks.append(Check(entry.cubin, True, f"{entry.size} bytes, sha256 {digest[:16]}…"))
    return checks


def _check_headers(read: Callable[[str], bytes | None], manifest: Manifest) -> list[Check]:
    checks = []
    index = read(INDEX_HEADER)
    expected = render_index_header(manifest)
    if index is None:
        checks.append(Check(INDEX_HEADER, False, "missing"))
    elif index.decode(errors="replace") != expected:
        checks.append(Check(INDEX_HEADER, False, "does not match the manifest: "
                            + _first_difference(expected, index.decode(errors="replace"))))
    else:
        checks.append(Check(INDEX_HEADER, True, f"matches the manifest ({len(manifest.kernels)} kernels)"))
    manifest_digest = sha256_bytes(read(MANIFEST_NAME))
    if manifest_digest != manifest_sha256(manifest):
        checks.append(Check(MANIFEST_NAME, False, f"sha256 {manifest_digest[:16]}… differs from the one "
                            "index.h records; the C++ loader will refuse this bundle (rewritten by hand?)"))
    contract_text = read(CONTRACT_HEADER)
    if contract_text is None:
        checks.append(Check(CONTRACT_HEADER, False, "missing"))
    elif contract_text.decode(errors="replace") != render_contract_header():
        checks.append(Check(CONTRACT_HEADER, False, "differs from this fagen's contract: "
                            + _first_difference(render_contract_header(), contract_text.decode(errors="replace"))))
    else:
        checks.append(Check(CONTRACT_HEADER, True, "matches this fagen's contract"))
    params = read(PARAMS_HEADER)
    found = _ABI_DEFINE.search(params.decode(errors="replace")) if params is not None else None
    if found is None:
        checks.append(Check(PARAMS_HEADER, False, "missing, or without #define FAGEN_ABI_VERSION"))
    elif int(found.group(1)) != manifest.abi_version:
        checks.append(Check(PARAMS_HEADER, False, f"declares ABI {found.group(1)}, the manifest "
                            f"{manifest.abi_version}"))
    else:
        checks.append(Check(PARAMS_HEADER, True, f"ABI {manifest.abi_version}"))
    return checks


def _directory_reader(root: Path) -> Callable[[str], bytes | None]:
    real_root = os.path.realpath(root)

    def read(name: str) -> bytes | None:
        # Names come from the manifest, checked by parse_manifest; a link out of the bundle
        # reads as missing, so nothing about its target is reported.
        path = root / name
        if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
            return None
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    return read


def verify_bundle(path: str | Path) -> tuple[list[Check], Manifest | None]:
    """Every check's outcome (see the module docstring), and the manifest when it could be read."""
    path = Path(path)
    checks: list[Check] = []
    if path.is_dir():
        read = _directory_reader(path)
    else:
        try:
            packed = read_packed(path)
        except BundleError as exc:
            return [Check("packed file", False, str(exc))], None
        checks.append(Check("packed file", True,
                            f"{len(packed.files)} members match SHA256SUMS (top-level {packed.top}/)"))
        read = packed.files.get
    manifest_checks, manifest = _check_manifest(read, str(path))
    checks += manifest_checks
    if manifest is not None:
        checks += _check_cubins(read, manifest)
        checks += _check_headers(read, manifest)
    return checks, manifest
