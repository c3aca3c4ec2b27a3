"""The CLI on a real build of specs/ci-small.yaml (kernels from the session's cache): the build
summary at 80 columns, output locations that cannot be written, packed bundles in `fagen list`,
and --json."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bundle_variants import copy_bundle, tamper_cubin
from fagen import paths
from fagen.bundle.format import read_manifest
from fagen.bundle.verify import verify_bundle
from fagen.cli import main

CI_SMALL = paths.specs_dir() / "ci-small.yaml"


@pytest.fixture(autouse=True)
def session_caches(kernel_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("FAGEN_CACHE", str(kernel_cache))
    monkeypatch.setenv("FAGEN_BUNDLE_CACHE", str(tmp_path / "bundle-cache"))
    monkeypatch.delenv("COLUMNS", raising=False)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def one_error(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def cli_process(*argv, env_extra: dict[str, str | None]) -> subprocess.CompletedProcess:
    env = {**os.environ}
    for key, value in env_extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable, "-m", "fagen.cli", *map(str, argv)], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)


# ---- the build summary ----

@pytest.mark.parametrize("columns", ["80", None], ids=["COLUMNS=80", "piped"])
def test_default_summary_fits_80_columns(ci_small, kernel_cache, tmp_path, columns):
    _, report = ci_small
    result = cli_process("build", CI_SMALL, "-o", tmp_path / "out", "-j", "1",
                         env_extra={"COLUMNS": columns, "FAGEN_CACHE": str(kernel_cache)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    too_long = [line for line in lines if len(line) > 80]
    assert not too_long, result.stdout
    header = next(line for line in lines if "algorithm" in line)
    for column in ("kernels", "compiled", "cached", "regs", "smem KB", "cubin KB"):
        assert column in header
    assert any("fa2 sm80" in line for line in lines) and any("fa2 sm90" in line for line in lines)
    n = len(report.kernels)
    assert f"{n} kernels (0 compiled, {n} cached), 0 skipped" in result.stdout
    assert not any(k.name in result.stdout for k in report.kernels)  # names only with -v
    assert len(lines) < 20


def test_verbose_lists_every_kernel(ci_small, tmp_path, capsys):
    _, report = ci_small
    code, out, _ = run(capsys, "build", CI_SMALL, "-o", tmp_path / "out", "-j", "1", "--verbose")
    assert code == 0
    # Piped without COLUMNS: the per-kernel table at its natural width, names whole.
    assert all(k.name in out for k in report.kernels)
    assert "compile s" in out and "regs" in out


# ---- output locations that cannot be written ----

def _chattr(flag: str, path: Path) -> bool:
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    except OSError:
        return False


def test_read_only_output_location(tmp_path, capsys):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    reason, immutable = "Permission denied", False
    try:
        if os.access(read_only, os.W_OK):
            # root ignores the mode; an immutable directory (ext4 and the like) stops it too.
            immutable = _chattr("+i", read_only)
            if not immutable:
                pytest.skip("running as root on a filesystem without chattr +i: cannot make a "
                            "read-only directory")
            reason = "Operation not permitted"
        code, _, err = run(capsys, "build", CI_SMALL, "-o", read_only / "x", "-j", "1")
    finally:
        if immutable:
            _chattr("-i", read_only)
        read_only.chmod(stat.S_IRWXU)
    assert code == 1
    line = one_error(err)
    assert line.startswith(f"error: cannot write the bundle to {read_only / 'x'}: {reason} (")
    assert line.endswith("); choose another -o")


def test_os_error_of_the_build_names_the_output(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out" / "x"

    def refuse(expansion, out_dir, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(out.parent / ".x.building-1"))

    monkeypatch.setattr("fagen.build.build_bundle", refuse)
    code, _, err = run(capsys, "build", CI_SMALL, "-o", out)
    assert code == 1
    assert one_error(err) == (f"error: cannot write the bundle to {out}: Permission denied "
                              f"({out.parent / '.x.building-1'}); choose another -o")


def test_os_error_in_the_kernel_cache_names_the_cache(kernel_cache, tmp_path, monkeypatch, capsys):
    locked = kernel_cache / "kernels" / "ab" / "entry.cubin"

    def refuse(expansion, out_dir, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(locked))

    monkeypatch.setattr("fagen.build.build_bundle", refuse)
    code, _, err = run(capsys, "build", CI_SMALL, "-o", tmp_path / "x")
    assert code == 1
    assert one_error(err) == (f"error: cannot write the kernel cache {kernel_cache}: Permission "
                              f"denied ({locked}); set FAGEN_CACHE to a writable directory")


@pytest.mark.parametrize("below", ["x", "sub/x"])
def test_output_below_a_file(tmp_path, below, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = a_file / below
    code, _, err = run(capsys, "build", CI_SMALL, "-o", out, "-j", "1")
    assert code == 1
    assert one_error(err) == (f"error: cannot write the bundle to {out}: {a_file} is a file, not a "
                              "directory; choose another -o")


def test_output_that_is_not_a_bundle_is_kept(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    code, _, err = run(capsys, "build", CI_SMALL, "-o", tmp_path, "-j", "1")
    assert code == 1
    assert one_error(err) == (f"error: {tmp_path.resolve()} exists and is not a fagen bundle (no "
                              "manifest.json); refusing to replace it: choose another -o")


# ---- packed bundles, --json ----

@pytest.fixture()
def packed(ci_small, tmp_path, capsys):
    bundle_dir, _ = ci_small
    target = tmp_path / "ci-small.tar.gz"
    code, _, _ = run(capsys, "pack", bundle_dir, "-o", target)
    assert code == 0
    return target


def test_pack_without_o_writes_beside_the_bundle(ci_small, tmp_path, monkeypatch, capsys):
    bundle_dir, _ = ci_small
    copy = tmp_path / "bundles" / "ci-small"
    shutil.copytree(bundle_dir, copy)
    monkeypatch.chdir(tmp_path)
    code, _, _ = run(capsys, "pack", copy)
    assert code == 0 and (copy.parent / "ci-small.tar.gz").is_file()
    assert not (tmp_path / "ci-small.tar.gz").exists()  # not the directory the command ran in


def test_list_of_a_packed_bundle_equals_the_directory(ci_small, packed, capsys):
    bundle_dir, _ = ci_small
    manifest = read_manifest(bundle_dir)
    code, out, _ = run(capsys, "list", packed)
    assert code == 0
    assert f"bundle {manifest.bundle} (fagen" in out
    assert all(k.key in out and k.name in out for k in manifest.kernels)
    code, from_file, _ = run(capsys, "list", packed, "--json")
    assert code == 0
    code, from_dir, _ = run(capsys, "list", bundle_dir, "--json")
    assert code == 0
    from_file, from_dir = json.loads(from_file), json.loads(from_dir)
    assert from_file["path"] == str(packed) and from_dir["path"] == str(bundle_dir)
    assert {**from_file, "path": None} == {**from_dir, "path": None}


def repacked(packed: Path, target: Path, edit) -> Path:
    """A copy of the packed bundle whose manifest `edit` changed, with matching SHA256SUMS (a
    packed file that fagen pack would refuse to write)."""
    import io
    import tarfile

    from fagen.bundle.pack import CHECKSUMS_NAME, checksums_text, read_packed

    bundle = read_packed(packed)
    files = dict(bundle.files)
    manifest = json.loads(files["manifest.json"])
    edit(manifest)
    files["manifest.json"] = json.dumps(manifest).encode()
    files[CHECKSUMS_NAME] = checksums_text(files).encode()
    with tarfile.open(target, "w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{bundle.top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return target


def test_list_of_a_packed_bundle_checks_the_manifest_paths(packed, tmp_path, capsys):
    def escape(manifest):
        manifest["kernels"][0]["cubin"] = "../outside.cubin"

    bad = repacked(packed, tmp_path / "bad.tar", escape)
    code, out, err = run(capsys, "list", bad)
    assert code == 1 and out == ""
    assert one_error(err).startswith(
        f"error: {bad} (manifest.json): kernels[0].cubin '../outside.cubin': ")
    assert one_error(err).endswith("(a manifest names files inside its bundle only); refusing the bundle")


def test_list_json_fields(ci_small, capsys):
    bundle_dir, _ = ci_small
    manifest = read_manifest(bundle_dir)
    code, out, err = run(capsys, "list", bundle_dir, "--json")
    assert code == 0 and err == ""
    listed = json.loads(out)
    assert listed["bundle"] == manifest.bundle and listed["fingerprint"] == manifest.fingerprint
    assert listed["schema_version"] == manifest.schema_version
    assert listed["abi_version"] == manifest.abi_version
    by_name = {k.name: k for k in manifest.kernels}
    assert sorted(k["name"] for k in listed["kernels"]) == sorted(by_name)
    for k in listed["kernels"]:
        entry = by_name[k["name"]]
        assert set(k) == {"key", "arch", "fa_version", "tile", "max_seqlen_k", "registers", "smem",
                          "size", "name"}
        assert (k["key"], k["arch"], k["fa_version"], k["max_seqlen_k"], k["size"]) == (
            entry.key, entry.arch, entry.fa_version, entry.max_seqlen_k, entry.size)
        assert k["registers"] == entry.resources.registers
        assert k["smem"] == entry.launch.dynamic_smem + entry.resources.static_smem
        assert k["tile"] in k["name"]


def test_list_without_dir_follows_fagen_bundle(packed, monkeypatch, capsys):
    monkeypatch.setenv("FAGEN_BUNDLE", str(packed))
    code, out, _ = run(capsys, "list", "--json")
    assert code == 0 and json.loads(out)["path"] == str(packed)


def test_verify_bundle_json(ci_small, packed, tmp_path, capsys):
    bundle_dir, _ = ci_small
    n = len(read_manifest(bundle_dir).kernels)
    n_checks = len(verify_bundle(bundle_dir)[0])  # one per cubin, the manifest and the headers
    code, out, err = run(capsys, "verify-bundle", bundle_dir, "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["path"] == str(bundle_dir) and report["ok"] is True
    assert len(report["checks"]) == n_checks > n and all(c["ok"] for c in report["checks"])
    assert all(set(c) == {"what", "ok", "detail"} for c in report["checks"])
    assert report["bundle"]["bundle"] == "ci-small" and len(report["bundle"]["kernels"]) == n

    code, out, _ = run(capsys, "verify-bundle", packed, "--json")
    assert code == 0 and json.loads(out)["checks"][0]["what"] == "packed file"

    tampered = copy_bundle(bundle_dir, tmp_path / "tampered")
    cubin = tamper_cubin(tampered)
    code, out, err = run(capsys, "verify-bundle", tampered, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert [c["what"] for c in report["checks"] if not c["ok"]] == [cubin.relative_to(tampered).as_posix()]
    assert one_error(err) == (f"error: {tampered}: 1 of {n_checks} checks failed; do not ship or load "
                              "this bundle")


def test_pack_output_errors(ci_small, tmp_path, capsys):
    bundle_dir, _ = ci_small
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    code, _, err = run(capsys, "pack", bundle_dir, "-o", a_file / "x.tar.gz")
    assert code == 1
    assert one_error(err) == (f"error: cannot write {a_file / 'x.tar.gz'}: {a_file} is a file, not a "
                              "directory; choose another -o")
    code, _, err = run(capsys, "pack", bundle_dir, "-o", tmp_path)
    assert code == 1
    assert one_error(err) == (f"error: {tmp_path} is a directory; give -o the packed file's name, "
                              f"e.g. {tmp_path / 'ci-small.tar.gz'}")
    code, _, err = run(capsys, "list", tmp_path / "a-file")
    assert code == 1 and one_error(err).startswith(f"error: {a_file}: ")
