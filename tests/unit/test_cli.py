"""The CLI without a compiler: error messages (never a traceback), --dry-run, bench, cache, help.

Builds that compile are in tests/compile/test_cli_build.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pydantic
import pytest

from fagen import paths
from fagen.cli import main
from fagen.model import ALGORITHMS, KernelSpec, SpecError, load_spec_file

CI_SMALL = paths.specs_dir() / "ci-small.yaml"
AVAILABLE = ", ".join(f"fa{v} {d}" + ("" if layout == "dense" else f" {layout}") for (v, d, layout) in ALGORITHMS)


def flat(text: str) -> str:
    """`text` without whitespace: what an assertion compares when rich may wrap a line."""
    return "".join(text.split())


def has(out: str, expected: str) -> bool:
    return flat(expected) in flat(out)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def one_error(err: str) -> str:
    """The stderr of a failed command: exactly one line, starting with `error: `."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def write_spec(tmp_path: Path, entry: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"bundle: b\nkernels:\n  - {{{entry}}}\n")
    return path


# ---- spec errors ----

def test_a_directory_as_spec_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="is a directory, not a spec file"):
        load_spec_file(tmp_path)


def test_cli_build_of_a_directory(capsys):
    code, out, err = run(capsys, "build", paths.specs_dir())
    assert code == 1
    assert one_error(err).startswith(f"error: {paths.specs_dir()} is a directory, not a spec file")
    assert "ci-small.yaml" in err  # it names the spec files the directory holds


def test_unreadable_spec_path(tmp_path, capsys):
    code, _, err = run(capsys, "build", tmp_path / "missing.yaml")
    assert code == 1 and one_error(err) == f"error: {tmp_path / 'missing.yaml'}: no such spec file"


def test_yaml_syntax_error_names_file_line_column_and_cause(tmp_path, capsys):
    bad = tmp_path / "broken.yaml"
    bad.write_text("bundle: b\nkernels:\n  - fa_version: 2\n    dtype: [fp16, bf16\n")
    code, _, err = run(capsys, "build", bad)
    assert code == 1
    line = one_error(err)
    # The cause survives (rich used to read "[fp16, bf16 ... ]" as markup), the file is named.
    assert line == (f"error: {bad}:5:1: not valid YAML: expected ',' or ']', but got "
                    "'<stream end>' (while parsing a flow sequence that began at line 4, column 12)")
    assert "<unicode string>" not in err


def test_yaml_error_in_the_library_api(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("bundle: b\nkernels: [a: b: c]\n")
    with pytest.raises(SpecError) as info:
        load_spec_file(bad)
    assert str(info.value).startswith(f"{bad}:2:") and "not valid YAML" in str(info.value)


def test_markup_in_paths_and_fields_is_printed_as_is(tmp_path, capsys):
    spec = write_spec(tmp_path, "fa_version: 2, arch: sm90, dtype: fp8, head_dim: 64",
                      name="[bold]x[red].yaml")
    code, _, err = run(capsys, "build", spec)
    assert code == 1
    assert one_error(err) == f"error: {spec}: kernels[0]: dtype: Input should be 'fp16', 'bf16' or 'e4m3'"
    named = tmp_path / "named.yaml"
    named.write_text("bundle: '[red]b[/red]'\nkernels: []\n")
    code, _, err = run(capsys, "build", named)
    assert code == 1 and one_error(err) == (
        f"error: {named}: spec file: bundle: bundle='[red]b[/red]': use letters, digits, '.', '_' "
        "and '-'")
    product = write_spec(tmp_path, "fa_version: 2, arch: sm90, dtype: ['[red]x[/red]', bf16], head_dim: 64")
    code, out, _ = run(capsys, "build", "-n", product)
    assert code == 0 and has(out, "skipped kernels[0] (dtype=[red]x[/red]): dtype:")


FA2_HEAD_DIMS = "the FA2 template needs a multiple of 16 up to 256 (mma.sync k-step and ldmatrix pairs)"


@pytest.mark.parametrize("head_dim", [512, 264, 100, 72, 0])
def test_head_dim_out_of_range_names_the_algorithms_limit_not_the_tuning_table(head_dim, tmp_path, capsys):
    # The algorithm's own rule, whole (100 once led to "a multiple of 8", then 72 to "FA2 needs a
    # multiple of 16"); 0 passes the FA2 rule's multiple but not its range.
    message = f"head_dim={head_dim}: {FA2_HEAD_DIMS}"
    with pytest.raises(pydantic.ValidationError) as info:
        KernelSpec.model_validate({"fa_version": 2, "arch": "sm90", "dtype": "bf16", "head_dim": head_dim})
    assert message in str(info.value) and "give the tile explicitly" not in str(info.value)
    spec = write_spec(tmp_path, f"fa_version: 2, arch: sm90, dtype: bf16, head_dim: {head_dim}")
    code, _, err = run(capsys, "build", spec)
    assert code == 1 and one_error(err) == f"error: {spec}: kernels[0]: {message}"


@pytest.mark.parametrize("tile", ["", ", tile: {block_m: 64, block_n: 64, warps: 4, stages: 2}"])
@pytest.mark.parametrize("fa_version", [5, 0])
def test_unknown_fa_version_lists_only_algorithms_with_a_template(fa_version, tile, tmp_path, capsys):
    if (fa_version, "fwd", "dense") in ALGORITHMS:
        pytest.skip(f"fa_version {fa_version} has a template now")
    spec = write_spec(tmp_path, f"fa_version: {fa_version}, arch: sm90, dtype: bf16, head_dim: 64{tile}")
    code, _, err = run(capsys, "build", spec)
    assert code == 1
    assert one_error(err) == (f"error: {spec}: kernels[0]: fa_version={fa_version}: fagen has no "
                              f"kernel template for it (available: {AVAILABLE})")
    assert "give the tile explicitly" not in err and "Input should be" not in err


def test_available_algorithms_come_from_the_registry():
    # fa_version 1 has a template (and tuning rows): accepted like the others.
    assert (1, "fwd", "dense") in ALGORITHMS and AVAILABLE.startswith("fa1 fwd")
    spec = KernelSpec.model_validate({"fa_version": 1, "arch": "sm90", "dtype": "bf16", "head_dim": 64})
    assert spec.name.startswith("fa1_fwd_sm90_bf16_hd64_full_m64n128w4_")


def test_head_dim_an_explicit_tile_cannot_serve_still_says_why(capsys, tmp_path):
    # 72 with an explicit FA2 tile: the geometry's problems() report the same rule.
    spec = write_spec(tmp_path, "fa_version: 2, arch: sm90, dtype: bf16, head_dim: 72, "
                                "tile: {block_m: 64, block_n: 64, warps: 4, stages: 2}")
    code, _, err = run(capsys, "build", spec)
    assert code == 1 and f"head_dim=72: {FA2_HEAD_DIMS}" in one_error(err)


def test_a_wrong_arch_is_the_only_error_of_an_auto_tile(capsys, tmp_path):
    spec = write_spec(tmp_path, "fa_version: 2, arch: sm75, dtype: bf16, head_dim: 64")
    code, _, err = run(capsys, "build", spec)
    assert code == 1 and one_error(err) == (
        f"error: {spec}: kernels[0]: arch: Input should be 'sm80', 'sm86', 'sm89', 'sm90', 'sm90a', "
        "'sm100a' or 'sm120'")


# ---- build --dry-run ----

def test_dry_run_lists_every_kernel_with_its_tile_and_writes_nothing(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "build", "--dry-run", CI_SMALL, "-o", out_dir)
    assert code == 0 and err == ""
    expansion = load_spec_file(CI_SMALL)
    lines = out.splitlines()
    for spec in expansion.specs:
        bound = "any seqlen_k" if spec.max_seqlen_k is None else f"seqlen_k <= {spec.max_seqlen_k}"
        assert f"  {spec.name}  (tile {spec.tile.short}, {bound})" in lines
    assert "fa2 sm80: 1 kernel" in lines and "fa2 sm90: 3 kernels" in lines
    assert "fa2 bwd sm90: 1 kernel" in lines
    assert "fa3 bwd sm90a: 1 kernel" in lines
    assert has(out, "6 kernels in 4 algorithm/arch groups")
    assert has(out, "nothing compiled or written")
    assert not out_dir.exists()


def test_arch_keeps_only_those_targets_kernels(tmp_path, capsys):
    code, out, err = run(capsys, "build", "--dry-run", CI_SMALL, "--arch", "sm90a", "-o", tmp_path / "out")
    assert code == 0 and err == ""
    assert "fa3 bwd sm90a: 1 kernel" in out.splitlines() and "fa2 sm90" not in out
    code, _, err = run(capsys, "build", "-n", CI_SMALL, "--arch", "sm100a")
    assert code == 1 and has(err, "--arch sm100a: the spec has no kernel for it (its targets: sm80, sm90, sm90a)")
    code, _, err = run(capsys, "build", "-n", CI_SMALL, "--arch", "sm90,hopper")
    assert code == 1 and has(err, "--arch sm90,hopper: hopper not a target")


def test_dry_run_reports_what_a_product_skips(tmp_path, capsys):
    spec = write_spec(tmp_path, "fa_version: 2, arch: [sm90, sm90a], dtype: bf16, head_dim: [64, 512]")
    code, out, _ = run(capsys, "build", "-n", spec)
    assert code == 0
    assert has(out, f"skipped kernels[0] (arch=sm90, head_dim=512): head_dim=512: {FA2_HEAD_DIMS}")
    assert has(out, "skipped kernels[0] (arch=sm90a, head_dim=64): arch=sm90a:")
    assert has(out, "1 kernel in 1 algorithm/arch group, 3 combinations skipped")


def test_dry_run_and_cache_do_not_import_the_compiler_or_torch():
    script = (
        "import sys\n"
        "from fagen.cli import main\n"
        f"assert main(['build', '--dry-run', {str(CI_SMALL)!r}]) == 0\n"
        "assert main(['cache']) == 0\n"
        "heavy = [m for m in sys.modules if m.startswith(('torch', 'cuda.bindings.nvrtc', "
        "'fagen.compiler', 'fagen.codegen', 'jinja2'))]\n"
        "print('HEAVY', heavy)\n"
    )
    env = {**os.environ, "FAGEN_CACHE": "/nonexistent/fagen-cache"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


def test_importing_the_cli_does_not_import_torch():
    result = subprocess.run(
        [sys.executable, "-c", "import sys, fagen.cli; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_jobs_must_be_positive(capsys):
    code, _, err = run(capsys, "build", "-n", CI_SMALL, "-j", "0")
    assert code == 1 and one_error(err) == "error: -j/--jobs must be at least 1"


# ---- bench ----

def test_bench_forwards_every_argument(monkeypatch):
    seen = []
    fake = types.ModuleType("bench.attention")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "bench.attention", fake)
    assert main(["bench", "--seqlens", "512,1k", "--bundle", "x", "--repeats", "3"]) == 7
    assert main(["bench"]) == 7
    assert seen == [["--seqlens", "512,1k", "--bundle", "x", "--repeats", "3"], []]


def test_bench_without_a_source_checkout(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bench.attention", None)  # import fails, as from a wheel
    code, _, err = run(capsys, "bench", "--seqlens", "512")
    assert code == 1
    assert one_error(err).startswith(
        "error: fagen bench runs the benchmark of a source checkout: clone the repository and "
        "`pip install -e .`; it needs torch and a CUDA GPU (import bench.attention: ")


# ---- help ----

def test_help_lists_the_environment(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("FAGEN_HOME", "FAGEN_BUNDLE ", "FAGEN_CACHE", "FAGEN_BUNDLE_CACHE", "XDG_CACHE_HOME"):
        assert name in out
    for command in ("build", "list", "pack", "verify-bundle", "bench", "cache"):
        assert f"    {command}" in out


@pytest.mark.parametrize("command, names", [
    ("list", ["FAGEN_BUNDLE", "--json"]), ("build", ["FAGEN_HOME", "FAGEN_CACHE", "--dry-run", "--verbose"]),
    ("verify-bundle", ["--json"]), ("cache", ["FAGEN_CACHE", "FAGEN_BUNDLE_CACHE", "XDG_CACHE_HOME"]),
])
def test_subcommand_help(command, names, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in names), out


# ---- list / pack / verify-bundle without a real bundle ----

def test_list_defaults_to_fagen_bundle(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAGEN_BUNDLE", str(tmp_path / "from-env.tar.gz"))
    code, _, err = run(capsys, "list")
    assert code == 1
    assert one_error(err) == f"error: {tmp_path / 'from-env.tar.gz'}: no such bundle directory or packed file"


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_list_of_things_that_are_not_bundles(tmp_path, json_flag, capsys):
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"not a tarball")
    code, out, err = run(capsys, "list", garbage, *json_flag)
    assert code == 1 and out == ""
    assert one_error(err) == f"error: {garbage}: not a packed fagen bundle (neither tar, gzip nor zstd)"
    odd = tmp_path / "odd"
    (odd / "manifest.json").mkdir(parents=True)  # a directory where the manifest file should be
    code, _, err = run(capsys, "list", odd, *json_flag)
    assert code == 1 and str(odd) in one_error(err)
    code, _, err = run(capsys, "list", tmp_path, *json_flag)
    assert code == 1 and one_error(err) == f"error: {tmp_path}: no manifest.json; is this a fagen bundle?"


def test_list_of_a_packed_file_whose_manifest_is_not_an_object(tmp_path, capsys):
    import io
    import tarfile

    from fagen.bundle.pack import CHECKSUMS_NAME, checksums_text

    files = {"manifest.json": b"[1, 2]"}
    files[CHECKSUMS_NAME] = checksums_text(files).encode()
    packed = tmp_path / "odd.tar"
    with tarfile.open(packed, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"odd/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    code, out, err = run(capsys, "list", packed)
    assert code == 1 and out == ""
    assert one_error(err) == f"error: {packed} (manifest.json): not a fagen manifest (no schema_version)"


def test_pack_errors(tmp_path, capsys):
    code, _, err = run(capsys, "pack", tmp_path / "missing")
    assert code == 1 and one_error(err) == f"error: {tmp_path / 'missing'}: no such bundle directory"
    a_file = tmp_path / "b.tar.gz"
    a_file.write_bytes(b"x")
    code, _, err = run(capsys, "pack", a_file)
    assert code == 1 and one_error(err) == (
        f"error: {a_file} is a file, not a bundle directory (fagen pack packs a directory that "
        "fagen build wrote)")
    code, _, err = run(capsys, "pack", tmp_path)
    assert code == 1 and "no manifest.json" in one_error(err)


def test_verify_bundle_errors(tmp_path, capsys):
    missing = tmp_path / "missing"
    code, out, err = run(capsys, "verify-bundle", missing)
    assert code == 1
    assert out == f"FAIL packed file: {missing}: no such packed bundle\n"
    assert one_error(err) == f"error: {missing}: 1 of 1 checks failed; do not ship or load this bundle"
    garbage = tmp_path / "g.tar"
    garbage.write_bytes(b"\0" * 10)
    code, out, err = run(capsys, "verify-bundle", garbage, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["path"] == str(garbage) and report["ok"] is False and report["bundle"] is None
    assert report["checks"] == [{"what": "packed file", "ok": False, "detail":
                                 f"{garbage}: not a packed fagen bundle (neither tar, gzip nor zstd)"}]
    assert one_error(err) == f"error: {garbage}: 1 of 1 checks failed; do not ship or load this bundle"


# ---- cache ----

KEY = "ab" + "0" * 62
SHA = "c" * 64


@pytest.fixture()
def caches(tmp_path, monkeypatch):
    kernel_root, bundle_root = tmp_path / "kernel-cache", tmp_path / "bundle-cache"
    monkeypatch.setenv("FAGEN_CACHE", str(kernel_root))
    monkeypatch.setenv("FAGEN_BUNDLE_CACHE", str(bundle_root))
    shard = kernel_root / "kernels" / KEY[:2]
    shard.mkdir(parents=True)
    (shard / f"{KEY}.cubin").write_bytes(b"x" * 1000)
    (shard / f"{KEY}.json").write_bytes(b"{}")
    (kernel_root / "nvrtc-headers" / "13.0").mkdir(parents=True)
    (kernel_root / "nvrtc-headers" / "13.0" / "cuda_fp16.h").write_bytes(b"y" * 2048)
    (bundle_root / SHA / "bundle").mkdir(parents=True)
    (bundle_root / SHA / "bundle" / "manifest.json").write_bytes(b"z" * 100)
    (bundle_root / "keep.txt").write_text("not fagen's")  # never removed: not a cache entry
    (kernel_root / "default").mkdir()  # e.g. a bundle built into the same root: never removed
    return kernel_root, bundle_root


def test_cache_show(caches, capsys):
    kernel_root, bundle_root = caches
    for argv in (["cache"], ["cache", "show"]):
        code, out, _ = run(capsys, *argv)
        assert code == 0
        assert has(out, f"kernel cache: {kernel_root / 'kernels'} 1 kernel, 1002 B (set by $FAGEN_CACHE)")
        assert has(out, f"NVRTC headers: {kernel_root / 'nvrtc-headers'} 1 NVRTC version, 2.0 KB")
        assert has(out, f"bundle cache: {bundle_root} 1 unpacked bundle, 100 B")


def test_cache_clear_each_and_all(caches, capsys):
    kernel_root, bundle_root = caches
    code, out, _ = run(capsys, "cache", "clear", "--bundles")
    assert code == 0 and has(out, f"removed bundle cache {bundle_root}: 1 unpacked bundle, 100 B")
    assert not (bundle_root / SHA).exists() and (bundle_root / "keep.txt").exists()
    assert (kernel_root / "kernels" / KEY[:2] / f"{KEY}.cubin").exists()

    code, out, _ = run(capsys, "cache", "clear", "--kernels")
    assert code == 0
    assert has(out, f"removed kernel cache {kernel_root / 'kernels'}: 1 kernel, 1002 B")
    assert has(out, f"removed NVRTC headers {kernel_root / 'nvrtc-headers'}: 1 NVRTC version, 2.0 KB")
    assert not (kernel_root / "kernels" / KEY[:2]).exists() and not (kernel_root / "nvrtc-headers").exists()
    assert (kernel_root / "default").is_dir()

    code, out, _ = run(capsys, "cache", "clear")  # --all is the default
    assert code == 0
    assert has(out, f"kernel cache {kernel_root / 'kernels'}: empty, nothing to remove")
    assert has(out, f"bundle cache {bundle_root}: empty, nothing to remove")


def test_cache_clear_options_are_exclusive(caches, capsys):
    with pytest.raises(SystemExit) as info:
        main(["cache", "clear", "--kernels", "--bundles"])
    assert info.value.code == 2


# ---- Ctrl-C ----

def test_ctrl_c_during_a_build_stops_the_queue(monkeypatch, tmp_path):
    from fagen import build

    started = []

    def slow_compile(rendered, source_dir, options, cache):
        started.append(rendered)
        time.sleep(0.2)
        return None, True

    def interrupted_wait(*args, **kwargs):  # Ctrl-C reaches the main thread inside wait()
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "_build_one", slow_compile)
    monkeypatch.setattr(build, "wait", interrupted_wait)
    from fagen.model import Arch

    arch = Arch("sm90")
    rendered = [types.SimpleNamespace(spec=types.SimpleNamespace(arch=arch)) for _ in range(40)]
    begin = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        build._compile_all(rendered, {arch: None}, tmp_path, 2, None, None)
    # Only the compiles already running finish (two jobs); the other 38 never start.
    assert len(started) <= 2 and time.monotonic() - begin < 1.0, (len(started), time.monotonic() - begin)


def test_ctrl_c_during_a_build_is_one_line_and_exit_130(monkeypatch, tmp_path, capsys):
    from fagen import build

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build_bundle", interrupted)
    code, _, err = run(capsys, "build", CI_SMALL, "-o", tmp_path / "bundle")
    assert code == 130
    assert one_error(err) == (f"error: interrupted: {tmp_path / 'bundle'} left as it was (the kernels "
                              "compiled so far are cached)")
