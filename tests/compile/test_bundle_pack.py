"""Packed bundles, `fagen verify-bundle` and the Python loader's refusals, on a freshly built bundle."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest

import fagen
from fagen import abi
from bundle_variants import OTHER_ABI_VERSION, copy_bundle, set_abi_version, tamper_cubin
from fagen.bundle.format import BundleError, read_manifest, read_verified_cubin
from fagen.bundle.pack import CHECKSUMS_NAME, pack_bundle
from fagen.cli import main as cli


@pytest.fixture()
def bundle_dir(ci_small):
    return ci_small[0]


@pytest.fixture(autouse=True)
def private_bundle_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_BUNDLE_CACHE", str(tmp_path / "bundle-cache"))


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_pack_then_load_round_trip(bundle_dir, tmp_path, suffix):
    packed = pack_bundle(bundle_dir, tmp_path / f"ci-small{suffix}")
    loaded = fagen.load(packed)
    original = fagen.load(bundle_dir)
    assert loaded.manifest == original.manifest
    assert loaded.path.parent.parent == tmp_path / "bundle-cache"
    for entry in loaded.kernels:
        assert read_verified_cubin(loaded.path, entry) == (bundle_dir / entry.cubin).read_bytes()
    assert fagen.load(packed).path == loaded.path, "a second load reuses the extracted copy"


def test_pack_is_deterministic(bundle_dir, tmp_path):
    first = pack_bundle(bundle_dir, tmp_path / "first.tar.gz").read_bytes()
    copy = copy_bundle(bundle_dir, tmp_path / "copy")
    for path in copy.rglob("*"):
        os.utime(path, (1, 1))
    assert pack_bundle(copy, tmp_path / "second.tar.gz").read_bytes() == first


def test_packed_layout(bundle_dir, tmp_path):
    packed = pack_bundle(bundle_dir, tmp_path / "ci-small.tar")
    with tarfile.open(packed) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert f"ci-small/{CHECKSUMS_NAME}" in names and "ci-small/manifest.json" in names
    assert "ci-small/include/fagen/fagen.hpp" in names and "ci-small/include/fagen/index.h" in names
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.isfile() for m in members)


def test_unknown_suffix_is_refused(bundle_dir, tmp_path):
    with pytest.raises(BundleError, match="unknown packed-bundle suffix"):
        pack_bundle(bundle_dir, tmp_path / "ci-small.zip")


def test_tampered_packed_member_is_refused(bundle_dir, tmp_path):
    packed = pack_bundle(bundle_dir, tmp_path / "ci-small.tar")
    data = bytearray(packed.read_bytes())
    cubin_bytes = (bundle_dir / fagen.load(bundle_dir).kernels[0].cubin).read_bytes()
    offset = bytes(data).index(cubin_bytes[:4096]) + 2048
    data[offset] ^= 0xFF
    packed.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"does not match {CHECKSUMS_NAME}"):
        fagen.load(packed)


def test_python_loader_refuses_tampered_cubin_at_open(bundle_dir, tmp_path):
    tampered = copy_bundle(bundle_dir, tmp_path / "tampered")
    cubin = tamper_cubin(tampered)
    with pytest.raises(BundleError, match=f"{cubin.name}: checksum mismatch"):
        fagen.load(tampered)


def test_unpack_cache_is_named_by_the_bytes_it_extracted(bundle_dir, tmp_path):
    packed = pack_bundle(bundle_dir, tmp_path / "ci-small.tar.gz")
    loaded = fagen.load(packed)
    assert loaded.path.parent.name == hashlib.sha256(packed.read_bytes()).hexdigest()
    assert (loaded.path.parent / CHECKSUMS_NAME).is_file()


def test_unpack_cache_hit_is_checked_again(bundle_dir, tmp_path):
    packed = pack_bundle(bundle_dir, tmp_path / "ci-small.tar.gz")
    extracted = fagen.load(packed).path
    header = extracted / "include/fagen/fagen.hpp"  # not a cubin: the manifest does not cover it
    header.write_text(header.read_text() + "// edited in the cache\n")
    with pytest.raises(BundleError, match="member include/fagen/fagen.hpp does not match SHA256SUMS.*unpacked"):
        fagen.load(packed)


def test_python_loader_refuses_other_abi(bundle_dir, tmp_path):
    other = copy_bundle(bundle_dir, tmp_path / "other-abi")
    set_abi_version(other)
    with pytest.raises(BundleError, match=f"kernel ABI version {OTHER_ABI_VERSION}.*ABI version {abi.ABI_VERSION}"):
        fagen.load(other)
    with pytest.raises(BundleError, match=f"kernel ABI version {OTHER_ABI_VERSION}"):
        pack_bundle(other, tmp_path / "other-abi.tar.gz")


def test_loading_a_packed_bundle_imports_no_build_stack(bundle_dir, tmp_path):
    packed = pack_bundle(bundle_dir, tmp_path / "ci-small.tar.gz")
    script = textwrap.dedent(f"""
        import sys
        import fagen
        bundle = fagen.load({str(packed)!r})
        bundle.select(bundle.kernels[0].key, tuple(bundle.kernels[0].compute_capability))
        loaded = [m for m in sys.modules
                  if m.split(".")[0] in ("jinja2", "pydantic", "yaml")
                  or m.startswith(("cuda.bindings.nvrtc", "fagen.compiler", "fagen.codegen", "fagen.model"))]
        assert not loaded, loaded
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ,
                   "FAGEN_BUNDLE_CACHE": str(tmp_path / "bundle-cache")})


def verify(path, capsys) -> tuple[int, str]:
    code = cli(["verify-bundle", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_verify_good_bundle_and_pack(bundle_dir, tmp_path, capsys):
    code, text = verify(bundle_dir, capsys)
    assert code == 0, text
    checks = len(read_manifest(bundle_dir).kernels) + 4  # + manifest, index.h, contract.h, params.h
    assert f"all {checks} checks passed" in text and "nvrtc" in text
    assert cli(["pack", str(bundle_dir), "-o", str(tmp_path / "ci-small.tar.gz")]) == 0
    code, text = verify(tmp_path / "ci-small.tar.gz", capsys)
    assert code == 0, text
    assert "members match SHA256SUMS" in text


def test_verify_tampered_cubin(bundle_dir, tmp_path, capsys):
    tampered = copy_bundle(bundle_dir, tmp_path / "tampered")
    cubin = tamper_cubin(tampered)
    code, text = verify(tampered, capsys)
    assert code == 1
    checks = len(read_manifest(tampered).kernels) + 4
    assert f"FAIL {cubin.relative_to(tampered).as_posix()}" in text and f"1 of {checks} checks failed" in text


@pytest.mark.parametrize("bad", ("/etc/hostname", "../../outside.cubin"))
def test_verify_refuses_paths_outside_the_bundle(bundle_dir, tmp_path, capsys, bad):
    edited = copy_bundle(bundle_dir, tmp_path / "edited")
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["kernels"][1]["cubin"] = bad
    (edited / "manifest.json").write_text(json.dumps(manifest))
    code, text = verify(edited, capsys)
    assert code == 1
    assert "FAIL manifest.json: " in text and f"kernels[1].cubin {bad!r}: not a normalised relative path" in text


def test_verify_other_abi(bundle_dir, tmp_path, capsys):
    other = copy_bundle(bundle_dir, tmp_path / "other-abi")
    set_abi_version(other)
    code, text = verify(other, capsys)
    assert code == 1
    assert f"kernel ABI version {OTHER_ABI_VERSION}" in text and f"speaks ABI version {abi.ABI_VERSION}" in text


def test_verify_index_out_of_step_with_manifest(bundle_dir, tmp_path, capsys):
    edited = copy_bundle(bundle_dir, tmp_path / "edited")
    index = edited / "include/fagen/index.h"
    text = index.read_text()
    assert ", 2, 0, 0},\n" in text  # fa_version, max_seqlen_k, min_split_keys of an FA2 row
    index.write_text(text.replace(", 2, 0, 0},\n", ", 3, 0, 0},\n", 1))
    code, text = verify(edited, capsys)
    assert code == 1
    assert "FAIL include/fagen/index.h: does not match the manifest" in text


def test_verify_missing_path(tmp_path, capsys):
    code, text = verify(tmp_path / "nothing.tar.gz", capsys)
    assert code == 1 and "no such packed bundle" in text
