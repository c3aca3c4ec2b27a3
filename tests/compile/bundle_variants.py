"""Broken copies of a built bundle, for the tests that check it is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fagen.bundle.cindex import INDEX_HEADER, render_index_header
from fagen.bundle.format import MANIFEST_NAME, Manifest

OTHER_ABI_VERSION = 99


def copy_bundle(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def tamper_cubin(bundle_dir: Path) -> Path:
    """Flip one byte of the first cubin; returns its path."""
    manifest = json.loads((bundle_dir / MANIFEST_NAME).read_text())
    cubin = bundle_dir / manifest["kernels"][0]["cubin"]
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    return cubin


def set_abi_version(bundle_dir: Path, version: int = OTHER_ABI_VERSION) -> None:
    """Rewrite the manifest and its index.h consistently, as a fagen of that ABI would have."""
    d = json.loads((bundle_dir / MANIFEST_NAME).read_text())
    d["abi_version"] = version
    manifest = Manifest.from_dict(d)
    (bundle_dir / MANIFEST_NAME).write_text(manifest.to_json())
    (bundle_dir / INDEX_HEADER).write_text(render_index_header(manifest))
