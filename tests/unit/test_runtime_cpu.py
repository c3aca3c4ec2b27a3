"""The runtime without a GPU: manifest checks, cubin selection, integrity, import hygiene."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fagen import abi
from fagen.bundle.format import SCHEMA_VERSION, sha256_bytes
from fagen.runtime import Bundle, BundleError, KernelNotFound, load, runs_on
from fagen.runtime.driver import kernel_param_array

ARCHS = {
    "sm80": ((8, 0), False),
    "sm86": ((8, 6), False),
    "sm90": ((9, 0), False),
    "sm90a": ((9, 0), True),
    "sm100a": ((10, 0), True),
    "sm120": ((12, 0), False),
}


def kernel_entry(arch: str, key: str, fa_version: int = 2, max_seqlen_k: int | None = None) -> dict:
    direction, dtype, head_dim, mask, *layout = key.split("/")
    bound = "" if max_seqlen_k is None else f"_upto{max_seqlen_k}"
    name = f"fa{fa_version}_{direction}_{arch}_{dtype}_{head_dim}_{mask}{''.join('_' + x for x in layout)}{bound}_test"
    data = f"cubin of {name}".encode()
    cc, arch_specific = ARCHS[arch]
    return {
        "name": name,
        "key": key,
        "arch": arch,
        "compute_capability": list(cc),
        "arch_specific": arch_specific,
        "fa_version": fa_version,
        "spec": {"fa_version": fa_version, "arch": arch},
        "cubin": f"cubin/{arch}/{name}.cubin",
        "source": f"src/{arch}/{name}.cu",
        "sha256": sha256_bytes(data),
        "size": len(data),
        "launch": {"threads": 128, "block_m": 128, "dynamic_smem": 65536},
        "resources": {"registers": 200, "spill_bytes": 0, "stack_bytes": 0, "static_smem": 0},
        "sass": ["HMMA"],
        "max_seqlen_k": max_seqlen_k,
    }


def write_bundle(root: Path, entries: list[dict], **overrides) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for e in entries:
        path = root / e["cubin"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"cubin of {e['name']}".encode())
    manifest = {
        "bundle": "test",
        "fingerprint": "0" * 16,
        "toolchain": {"nvrtc": "13.5"},
        "kernels": entries,
        "schema_version": SCHEMA_VERSION,
        "abi_version": abi.ABI_VERSION,
        "fagen_version": "0.0.0",
        "skipped": [],
        **overrides,
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return root


KEY = "fwd/bf16/hd128/causal"


@pytest.fixture
def hopper_bundle(tmp_path) -> Bundle:
    return load(write_bundle(tmp_path / "b", [
        kernel_entry("sm80", KEY), kernel_entry("sm90", KEY), kernel_entry("sm90a", KEY, fa_version=3),
        kernel_entry("sm86", KEY), kernel_entry("sm80", "fwd/fp16/hd64/full"),
    ]))


def test_prefers_newer_algorithm_on_its_exact_arch(hopper_bundle):
    chosen = hopper_bundle.select(KEY, (9, 0))
    assert (chosen.arch, chosen.fa_version) == ("sm90a", 3)


def test_plain_cubin_runs_on_later_minor_only(hopper_bundle):
    assert hopper_bundle.select(KEY, (8, 0)).arch == "sm80"
    assert hopper_bundle.select(KEY, (8, 6)).arch == "sm86"
    assert hopper_bundle.select(KEY, (8, 9)).arch == "sm86"  # closest capability wins


def test_blackwell_devices_take_fa4_on_sm100_and_fa2_on_sm120(tmp_path):
    """specs/blackwell.yaml's selection: a B200 (10.0) runs FA4 where the bundle has it and the
    sm100a FA2 build for the rest (a window); an RTX 50-series (12.0, no tcgen05) runs the sm120
    FA2 build; neither runs a Hopper or Ampere cubin (no cubin runs across major versions)."""
    local = "fwd/bf16/hd128/local"
    bundle = load(write_bundle(tmp_path / "b", [
        kernel_entry("sm100a", KEY, fa_version=4), kernel_entry("sm100a", KEY), kernel_entry("sm120", KEY),
        kernel_entry("sm100a", local), kernel_entry("sm120", local), kernel_entry("sm90a", KEY, fa_version=3),
        kernel_entry("sm80", KEY), kernel_entry("sm90", local),
    ]))
    assert (bundle.select(KEY, (10, 0)).arch, bundle.select(KEY, (10, 0)).fa_version) == ("sm100a", 4)
    assert (bundle.select(local, (10, 0)).arch, bundle.select(local, (10, 0)).fa_version) == ("sm100a", 2)
    for cc in ((12, 0), (12, 1)):
        for key in (KEY, local):
            assert (bundle.select(key, cc).arch, bundle.select(key, cc).fa_version) == ("sm120", 2)
    with pytest.raises(KernelNotFound):
        bundle.select(local, (10, 3))  # an sm100a cubin runs on 10.0 only


def test_blackwell_spec_covers_the_model_families_on_sm100_and_sm120(tmp_path):
    """specs/blackwell.yaml's own kernels: a B200 takes FA4 where it was built (forward and
    backward at head dims 64, 128 and 192 / 128, the forward's 256 with a mask, windows, the
    softcap (the backward's at 128), ALiBi, sinks) and FA2's sm100a build for the rest (head dim
    256's backward);
    an RTX 50-series the sm120 FA2 build; both have every model family's variant in both
    directions (Gemma-2, gpt-oss, Mistral, BLOOM, DeepSeek-V3) and packed variable-length
    batches (FA4 on sm100a, but the backward at head dim 256)."""
    from fagen import paths
    from fagen.model import load_spec_file

    specs = load_spec_file(paths.specs_dir() / "blackwell.yaml").specs
    found = {(s.lookup_key, s.arch.value, s.fa_version) for s in specs if s.layout != "paged"}
    bundle = load(write_bundle(tmp_path / "b", [kernel_entry(arch, key, fa_version=v) for key, arch, v in sorted(found)]))
    fa4 = ["bwd/bf16/hd128/causal", "bwd/fp16/hd64/local", "bwd/bf16/hd64/local+sinks", "bwd/bf16/hd128/causal+alibi",
           "fwd/bf16/hd128/local", "fwd/fp16/hd256/causal", "fwd/bf16/hd64/local+sinks", "fwd/bf16/hd128/causal+softcap",
           "bwd/bf16/hd192v128/causal", "bwd/bf16/hd192v128/full", "bwd/bf16/hd128/causal+softcap",
           "bwd/bf16/hd128/local+softcap", "fwd/bf16/hd128/local+softcap", "fwd/bf16/hd256/causal+softcap",
           "fwd/bf16/hd256/local+softcap"]
    for key in fa4:
        assert (bundle.select(key, (10, 0)).arch, bundle.select(key, (10, 0)).fa_version) == ("sm100a", 4), key
    families = [f"{d}/bf16/hd{h}/{m}+softcap" for d in ("fwd", "bwd") for h in (128, 256) for m in ("causal", "local")]
    families += [f"{d}/bf16/hd64/{m}+sinks" for d in ("fwd", "bwd") for m in ("causal", "local")]
    families += [f"{d}/bf16/hd128/{m}" for d in ("fwd", "bwd") for m in ("local", "causal+alibi")]
    families += [f"{d}/bf16/hd192v128/causal" for d in ("fwd", "bwd")] + ["bwd/bf16/hd256/causal", "fwd/bf16/hd256/full"]
    families += [f"{d}/{t}/hd{h}/{m}/varlen" for d in ("fwd", "bwd") for t in ("bf16", "fp16") for h in (64, 128, 256)
                 for m in ("full", "causal")] + [f"{d}/bf16/hd128/local/varlen" for d in ("fwd", "bwd")]
    for key in families:
        assert bundle.select(key, (10, 0)).arch == "sm100a", key
        assert (bundle.select(key, (12, 0)).arch, bundle.select(key, (12, 0)).fa_version) == ("sm120", 2), key
    assert bundle.select("bwd/bf16/hd256/local+softcap", (10, 0)).fa_version == 2
    for key in ("fwd/fp16/hd256/causal/varlen", "bwd/bf16/hd128/local/varlen", "bwd/fp16/hd64/full/varlen",
                "fwd/e4m3/hd128/causal", "fwd/e4m3/hd256/local"):
        assert bundle.select(key, (10, 0)).fa_version == 4, key


def test_fa2_on_sm90_when_no_arch_specific_build(tmp_path):
    bundle = load(write_bundle(tmp_path / "b", [kernel_entry("sm80", KEY), kernel_entry("sm90", KEY)]))
    assert bundle.select(KEY, (9, 0)).arch == "sm90"


def test_seqlen_bounds_pick_the_tightest_covering_kernel(tmp_path):
    bundle = load(write_bundle(tmp_path / "b", [
        kernel_entry("sm90a", KEY, fa_version=3),
        kernel_entry("sm90a", KEY, fa_version=3, max_seqlen_k=1024),
        kernel_entry("sm90a", KEY, fa_version=3, max_seqlen_k=4096),
        kernel_entry("sm90", KEY, max_seqlen_k=100000),  # another family: never a candidate
    ]))
    bound_of = {1: 1024, 1024: 1024, 1025: 4096, 4096: 4096, 4097: None, 10**6: None}
    for seqlen_k, bound in bound_of.items():
        chosen = bundle.select(KEY, (9, 0), seqlen_k)
        assert (chosen.arch, chosen.max_seqlen_k) == ("sm90a", bound), seqlen_k
    assert bundle.select(KEY, (9, 0)).max_seqlen_k is None  # length unknown: the unbounded one


def test_only_bounded_kernels_still_serve_every_length(tmp_path):
    # A bound is a preference, not a limit: past every bound the loosest one runs.
    bundle = load(write_bundle(tmp_path / "b", [
        kernel_entry("sm90a", KEY, fa_version=3, max_seqlen_k=512),
        kernel_entry("sm90a", KEY, fa_version=3, max_seqlen_k=2048),
    ]))
    assert bundle.select(KEY, (9, 0), 100).max_seqlen_k == 512
    assert bundle.select(KEY, (9, 0), 600).max_seqlen_k == 2048
    assert bundle.select(KEY, (9, 0), 10**6).max_seqlen_k == 2048


def test_schema_1_manifests_read_as_unbounded(tmp_path):
    entry = kernel_entry("sm90a", KEY, fa_version=3)
    del entry["max_seqlen_k"]
    bundle = load(write_bundle(tmp_path / "b", [entry], schema_version=1))
    assert bundle.select(KEY, (9, 0), 64).max_seqlen_k is None


@pytest.mark.parametrize("grid, expected", [
    ("tiles", [(64, 16, 4), (1, 2, 1)]),
    ("persistent", [(132, 1, 1), (2, 1, 1)]),  # never more CTAs than tiles
    ("heads", [(16, 4, 1), (2, 1, 1)]),
])
def test_launch_grid_shapes(tmp_path, monkeypatch, grid, expected):
    from fagen.runtime import driver, loader

    monkeypatch.setattr(driver, "multiprocessor_count", lambda device: 132)
    entry = kernel_entry("sm90a", KEY, fa_version=3)
    entry["launch"] = {**entry["launch"], "block_m": 64, "grid": grid}
    (kernel,) = load(write_bundle(tmp_path / "b", [entry])).kernels
    # seqlen 4096, 16 heads, batch 4: 64 x 16 x 4 = 4096 tiles; then 64 keys, 2 heads, batch 1.
    assert [loader.launch_grid(kernel, 4096, 16, 4, 0), loader.launch_grid(kernel, 64, 2, 1, 0)] == expected


@pytest.mark.parametrize("persistent", (False, True))
def test_schema_2_launches_read_as_grids(tmp_path, persistent):
    entry = kernel_entry("sm90a", KEY, fa_version=3)
    entry["launch"] = {**entry["launch"], "persistent": persistent, "ctas_per_sm": 1}
    (kernel,) = load(write_bundle(tmp_path / "b", [entry], schema_version=2)).kernels
    assert kernel.launch.grid == ("persistent" if persistent else "tiles")


def test_unknown_grid_is_refused(tmp_path):
    entry = kernel_entry("sm90a", KEY, fa_version=3)
    entry["launch"] = {**entry["launch"], "grid": "spiral"}
    with pytest.raises(BundleError, match="launch.grid 'spiral' is not one of tiles, persistent, heads"):
        load(write_bundle(tmp_path / "b", [entry]))


def test_runs_on_rules(hopper_bundle):
    by_arch = {e.arch: e for e in hopper_bundle.kernels if e.key == KEY}
    assert runs_on(by_arch["sm80"], (8, 6))
    assert not runs_on(by_arch["sm80"], (9, 0))  # SASS is compatible within a major only
    assert not runs_on(by_arch["sm86"], (8, 0))
    assert runs_on(by_arch["sm90a"], (9, 0))
    assert not runs_on(by_arch["sm90a"], (10, 0))
    assert not runs_on(by_arch["sm90"], (10, 0))


def test_sm80_only_bundle_does_not_serve_hopper(tmp_path):
    bundle = load(write_bundle(tmp_path / "b", [
        kernel_entry("sm80", KEY), kernel_entry("sm80", "fwd/bf16/hd64/causal"), kernel_entry("sm80", "fwd/fp16/hd64/full"),
    ]))
    with pytest.raises(KernelNotFound) as info:
        bundle.select(KEY, (9, 0))
    message = str(info.value)
    assert KEY in message and "9.0" in message
    assert "sm80 (fa2): fwd/bf16/hd{64,128}/causal, fwd/fp16/hd64/full" in message
    assert "built only for sm80" in message
    assert "{fa_version: 2, arch: sm90, direction: fwd, dtype: bf16, head_dim: 128, mask: causal}" in message
    assert f"fagen build SPEC -o {bundle.path}" in message


def test_missing_head_dim_message(hopper_bundle):
    with pytest.raises(KernelNotFound) as info:
        hopper_bundle.select("fwd/bf16/hd96/full", (9, 0))
    message = str(info.value)
    assert "'fwd/bf16/hd96/full'" in message and "9.0" in message
    assert "sm90a (fa3): fwd/bf16/hd128/causal" in message
    assert "head_dim: 96, mask: full}" in message
    assert "built only for" not in message


def test_empty_bundle_message(tmp_path):
    bundle = load(write_bundle(tmp_path / "b", []))
    with pytest.raises(KernelNotFound, match="holds no kernels"):
        bundle.select(KEY, (9, 0))


def test_tampered_cubin_is_refused_at_open(hopper_bundle):
    entry = hopper_bundle.select(KEY, (9, 0))
    (hopper_bundle.path / entry.cubin).write_bytes(b"cubin of something else")
    with pytest.raises(BundleError, match=f"{entry.name}.cubin: checksum mismatch"):
        load(hopper_bundle.path)


def test_missing_cubin_is_refused_at_open(hopper_bundle):
    entry = hopper_bundle.select(KEY, (9, 0))
    (hopper_bundle.path / entry.cubin).unlink()
    with pytest.raises(BundleError, match="cubin listed in the manifest is missing"):
        load(hopper_bundle.path)


def test_an_open_bundle_never_reads_its_files_again(hopper_bundle):
    # Rebuilding or damaging the directory after the open reaches no process that opened it:
    # every cubin was read and verified then.
    entry = hopper_bundle.select(KEY, (9, 0))
    (hopper_bundle.path / entry.cubin).write_bytes(b"cubin of something else")
    assert hopper_bundle._images[entry.name] == f"cubin of {entry.name}".encode()


def test_a_bundle_swapped_while_opening_is_read_again(tmp_path, monkeypatch):
    # The first read of a cubin finds the next build's file; the manifest changed meanwhile, so
    # the open starts over and returns one consistent snapshot.
    from fagen.bundle import format as bundle_format

    root = write_bundle(tmp_path / "b", [kernel_entry("sm90", KEY)])
    reads = []
    real = bundle_format.read_verified_cubin

    def racing_read(bundle_dir, entry):
        reads.append(entry.name)
        if len(reads) == 1:
            manifest = json.loads((root / "manifest.json").read_text())
            manifest["fingerprint"] = "1" * 16
            (root / "manifest.json").write_text(json.dumps(manifest))
            raise BundleError("checksum mismatch")
        return real(bundle_dir, entry)

    monkeypatch.setattr(bundle_format, "read_verified_cubin", racing_read)
    bundle = load(root)
    assert len(reads) == 2 and bundle.manifest.fingerprint == "1" * 16


@pytest.mark.parametrize("field", ("cubin", "source"))
@pytest.mark.parametrize("bad", ("/etc/passwd", "../outside.cubin", "cubin/../../x", "cubin//x",
                                 "./cubin/x", "cubin\\x", ""))
def test_manifest_paths_outside_the_bundle_are_refused(tmp_path, field, bad):
    entry = kernel_entry("sm90", KEY)
    root = write_bundle(tmp_path / "b", [entry])
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["kernels"][0][field] = bad
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError) as info:
        load(root)
    message = str(info.value)
    assert f"kernels[0].{field} {bad!r}: not a" in message
    assert "bytes" not in message and "sha256" not in message  # nothing about the target


def test_a_cubin_linked_outside_the_bundle_is_refused(tmp_path):
    entry = kernel_entry("sm90", KEY)
    root = write_bundle(tmp_path / "b", [entry])
    outside = tmp_path / "outside.cubin"
    (root / entry["cubin"]).rename(outside)
    (root / entry["cubin"]).symlink_to(outside)
    with pytest.raises(BundleError, match="resolves outside the bundle"):
        load(root)


def test_other_abi_is_refused(tmp_path):
    path = write_bundle(tmp_path / "b", [kernel_entry("sm90", KEY)], abi_version=abi.ABI_VERSION + 1)
    with pytest.raises(BundleError) as info:
        load(path)
    message = str(info.value)
    assert f"ABI version {abi.ABI_VERSION + 1}" in message and f"ABI version {abi.ABI_VERSION}" in message


def test_newer_schema_is_refused(tmp_path):
    path = write_bundle(tmp_path / "b", [kernel_entry("sm90", KEY)], schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(BundleError, match=f"schema_version {SCHEMA_VERSION + 1} is newer"):
        load(path)


def test_missing_bundle(tmp_path):
    with pytest.raises(BundleError, match="no manifest.json"):
        load(tmp_path / "nowhere")


def test_default_bundle_dir_comes_from_fagen_home(tmp_path, monkeypatch):
    write_bundle(tmp_path / "default", [kernel_entry("sm90", KEY)])
    monkeypatch.setenv("FAGEN_HOME", str(tmp_path))
    assert load().path == (tmp_path / "default").resolve()


def test_kernel_param_array_points_at_the_struct():
    params = abi.FwdParams(batch=3, heads_q=5, scale_log2=0.25)
    pointers, address = kernel_param_array(params)
    assert address == ctypes.addressof(pointers)
    first = ctypes.cast(address, ctypes.POINTER(ctypes.c_void_p))[0]
    assert first == ctypes.addressof(params)
    seen = abi.FwdParams.from_address(first)
    assert (seen.batch, seen.heads_q, seen.scale_log2) == (3, 5, 0.25)


def test_runtime_imports_no_build_stack():
    code = textwrap.dedent(
        """
        import sys
        import fagen.runtime
        try:
            import fagen.torch
        except ImportError as exc:
            if "torch" not in str(exc):
                raise
        forbidden = ("pydantic", "jinja2", "fagen.model", "fagen.codegen", "fagen.compiler",
                     "fagen.build", "fagen.bundle.writer", "cuda.bindings.nvrtc", "nvidia.cuda_nvrtc", "yaml")
        loaded = sorted(m for m in sys.modules if m.startswith(forbidden))
        print(",".join(loaded))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"runtime path imported: {result.stdout.strip()}"


class FakeDriver:
    """Stands in for cuda.bindings.driver's calls (its types and enums are the real ones, which
    need no GPU): records what fagen asks the driver to do."""

    def __init__(self, real, current_context=0, context_device=0):
        self._real = real
        self.current_context = current_context
        self.context_device = context_device
        self.calls = []
        self.launches = []
        self.kernel_handles: dict[str, int] = {}
        self.pushed = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _ok(self, name, *values):
        self.calls.append(name)
        return (self._real.CUresult.CUDA_SUCCESS, *values)

    def cuInit(self, flags):
        return self._ok("cuInit")

    def cuDeviceGet(self, ordinal):
        return self._ok("cuDeviceGet", self._real.CUdevice(ordinal))

    def cuCtxGetCurrent(self):
        return self._ok("cuCtxGetCurrent", self._real.CUcontext(self.current_context))

    def cuCtxGetDevice(self):
        return self._ok("cuCtxGetDevice", self._real.CUdevice(self.context_device))

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._ok("cuDevicePrimaryCtxRetain", self._real.CUcontext(0x1000 + int(dev)))

    def cuCtxSetCurrent(self, ctx):
        self.current_context, self.context_device = int(ctx), int(ctx) - 0x1000
        return self._ok("cuCtxSetCurrent")

    def cuCtxPushCurrent(self, ctx):
        self.pushed.append((self.current_context, self.context_device))
        self.current_context, self.context_device = int(ctx), int(ctx) - 0x1000
        return self._ok("cuCtxPushCurrent")

    def cuCtxPopCurrent(self):
        popped = self.current_context
        self.current_context, self.context_device = self.pushed.pop()
        return self._ok("cuCtxPopCurrent", self._real.CUcontext(popped))

    def cuLibraryLoadData(self, code, *options):
        assert isinstance(code, bytes) and options == (None, None, 0, None, None, 0)
        return self._ok("cuLibraryLoadData", self._real.CUlibrary(0x2000))

    def cuLibraryGetKernel(self, library, name):
        # The first kernel asked for (the main one) is 0x3000, each other entry point its own.
        assert int(library) == 0x2000 and isinstance(name, bytes)
        handle = self.kernel_handles.setdefault(name.decode(), 0x3000 + 0x10 * len(self.kernel_handles))
        return self._ok("cuLibraryGetKernel", self._real.CUkernel(handle))

    def cuKernelSetAttribute(self, attrib, value, kernel, dev):
        assert attrib == self._real.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self.calls.append(("smem", value, int(kernel), int(dev)))
        return (self._real.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernelEx(self, config, kernel, kernel_params, extra):
        first = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))[0]
        params = abi.FwdParams.from_buffer_copy(ctypes.string_at(first, ctypes.sizeof(abi.FwdParams)))
        self.launches.append({
            "grid": (config.gridDimX, config.gridDimY, config.gridDimZ),
            "block": (config.blockDimX, config.blockDimY, config.blockDimZ),
            "smem": config.sharedMemBytes, "stream": int(config.hStream), "kernel": int(kernel),
            "params": params, "extra": extra, "context": self.current_context,
            "name": {h: n for n, h in self.kernel_handles.items()}.get(int(kernel)),
            "merge_params": abi.MergeParams.from_buffer_copy(ctypes.string_at(first, ctypes.sizeof(abi.MergeParams))),
        })
        return self._ok("cuLaunchKernelEx")


@pytest.fixture
def fake_driver(monkeypatch):
    from fagen.runtime import driver

    # As torch leaves it: device 0's primary context (the fake's primary of device n is 0x1000 + n).
    fake = FakeDriver(driver.cu, current_context=0x1000, context_device=0)
    monkeypatch.setattr(driver, "cu", fake)
    monkeypatch.setattr(driver, "_initialized", False)
    monkeypatch.setattr(driver, "_primary_contexts", {})
    return fake


def test_launch_goes_through_the_driver_once_prepared(hopper_bundle, fake_driver):
    entry = hopper_bundle.select(KEY, (9, 0))
    kernel = hopper_bundle.kernel(entry)
    assert hopper_bundle.kernel(entry) is kernel
    params = abi.FwdParams(batch=2, heads_q=8, heads_kv=1, seqlen_q=300, seqlen_k=128, scale_log2=0.5)
    for _ in range(2):
        kernel.launch(params, (3, 8, 2), stream=0xABC, device=0)
    assert fake_driver.calls.count("cuLibraryLoadData") == 1
    assert fake_driver.calls.count("cuLibraryGetKernel") == 1
    assert fake_driver.calls.count(("smem", 65536, 0x3000, 0)) == 1
    assert "cuCtxPushCurrent" not in fake_driver.calls  # device 0's primary context is current
    assert len(fake_driver.launches) == 2
    launch = fake_driver.launches[0]
    assert launch["grid"] == (3, 8, 2) and launch["block"] == (128, 1, 1)
    assert (launch["smem"], launch["stream"], launch["kernel"], launch["extra"]) == (65536, 0xABC, 0x3000, 0)
    seen = launch["params"]
    assert (seen.batch, seen.heads_q, seen.heads_kv, seen.seqlen_q, seen.seqlen_k) == (2, 8, 1, 300, 128)
    assert seen.scale_log2 == 0.5


def test_launch_without_a_current_context_uses_the_primary_one(hopper_bundle, fake_driver):
    fake_driver.current_context = 0
    kernel = hopper_bundle.kernel(hopper_bundle.select(KEY, (9, 0)))
    kernel.launch(abi.FwdParams(), (1, 1, 1), stream=0, device=1)
    assert "cuDevicePrimaryCtxRetain" in fake_driver.calls
    assert fake_driver.launches[0]["context"] == 0x1001
    assert ("smem", 65536, 0x3000, 1) in fake_driver.calls
    assert fake_driver.current_context == 0, "the launch left a context current"


@pytest.mark.parametrize("current", (0x5000, 0x1001), ids=("own_context", "other_device"))
def test_launch_puts_the_callers_context_back(hopper_bundle, fake_driver, current):
    # A context of the caller's own on device 0 (0x5000), or device 1's primary context: the
    # kernel runs in device 0's primary context, and the caller's is current again afterwards.
    fake_driver.current_context = current
    kernel = hopper_bundle.kernel(hopper_bundle.select(KEY, (9, 0)))
    kernel.launch(abi.FwdParams(), (1, 1, 1), stream=0, device=0)
    assert fake_driver.launches[0]["context"] == 0x1000
    assert fake_driver.current_context == current and fake_driver.pushed == []


def test_driver_errors_name_the_call():
    from fagen.runtime.driver import DriverError, check, cu

    with pytest.raises(DriverError, match=r"cuFoo failed: .*"):
        check("cuFoo", (cu.CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(DriverError, match=r"cuFoo failed: .*"):
        check("cuFoo", (cu.CUresult.CUDA_ERROR_INVALID_VALUE, 7))
    with pytest.raises(DriverError, match=r"cuFoo failed: .*"):
        check("cuFoo", cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    assert check("cuBar", (cu.CUresult.CUDA_SUCCESS,)) is None
    assert check("cuBar", (cu.CUresult.CUDA_SUCCESS, 7)) == 7
    assert check("cuBar", (cu.CUresult.CUDA_SUCCESS, 7, 8)) == (7, 8)
    assert check("cuBar", cu.CUresult.CUDA_SUCCESS) is None


def test_launches_keep_their_own_grid_block_memory_and_stream(fake_driver):
    """Launch configurations are kept per (grid, block, shared memory, stream): a launch that
    differs in any one of them gets its own."""
    from fagen.runtime import driver

    configurations = [((3, 8, 2), (128, 1, 1), 65536, 0xABC), ((3, 8, 2), (128, 1, 1), 65536, 0xDEF),
                      ((4, 8, 2), (128, 1, 1), 65536, 0xABC), ((3, 8, 2), (256, 1, 1), 65536, 0xABC),
                      ((3, 8, 2), (128, 1, 1), 1024, 0xABC)]
    for _ in range(2):
        for grid, block, smem, stream in configurations:
            driver.launch(driver.cu.CUkernel(0x3000), grid, block, smem, stream, (abi.FwdParams(batch=stream),))
    assert [(launch["grid"], launch["block"], launch["smem"], launch["stream"]) for launch in fake_driver.launches] == (
        configurations * 2)
    assert [launch["params"].batch for launch in fake_driver.launches] == [stream for *_, stream in configurations] * 2


def test_launch_passes_extra_parameters_in_order(hopper_bundle, fake_driver):
    kernel = hopper_bundle.kernel(hopper_bundle.select(KEY, (9, 0)))
    maps = (ctypes.c_ubyte * 384).from_buffer_copy(bytes(range(128)) * 3)
    seen = []
    real_launch = fake_driver.cuLaunchKernelEx

    def launch(config, f, kernel_params, extra):
        pointers = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))
        seen.append(ctypes.string_at(pointers[1], 384))
        return real_launch(config, f, kernel_params, extra)

    fake_driver.cuLaunchKernelEx = launch
    kernel.launch(abi.FwdParams(batch=4), (1, 1, 4), stream=0, device=0, extra_params=(maps,))
    assert seen == [bytes(maps)]
    assert fake_driver.launches[0]["params"].batch == 4


def test_tensor_map_arguments_convert(monkeypatch):
    """The real cuda.bindings call accepts our argument types: without a driver it fails only
    when it reaches libcuda, not with a TypeError."""
    from fagen.runtime import driver

    monkeypatch.setattr(driver, "init", lambda: None)
    with pytest.raises(RuntimeError, match="driver library|cuda"):
        driver.encode_tiled_tensor_map("bf16", 0x10000, (128, 300, 4, 2), (1024, 256, 307200), (64, 128, 1, 1))
