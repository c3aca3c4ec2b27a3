"""fagen.runtime.call without a GPU: the torch-free attention call checks, selects, fills the
parameters and the TMA maps, and launches through the (fake) driver."""

from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys

import pytest

from fagen import abi, contract
from fagen.runtime import (AttentionError, BackwardPointers, KernelNotFound, Problem, ScaleError, Tensor, load, prepare,
                           prepare_backward)
from fagen.runtime import call, driver

from test_runtime_cpu import FakeDriver, kernel_entry, write_bundle  # noqa: E402 (tests/unit is on sys.path)

KEY = "fwd/bf16/hd128/causal"
PROBLEM = Problem("bf16", True, batch=2, seqlen_q=300, seqlen_k=500, heads_q=4, heads_kv=1, head_dim=128)


def _tensor(address: int, seqlen: int, heads: int) -> Tensor:
    return Tensor.contiguous(address, seqlen, heads, 128)


Q, K, V, OUT = (_tensor(0x10000, 300, 4), _tensor(0x20000, 500, 1), _tensor(0x30000, 500, 1),
                _tensor(0x40000, 300, 4))


class CallDriver(FakeDriver):
    """FakeDriver with a compute capability 9.0 device of 132 SMs."""

    def cuDeviceGetAttribute(self, attribute, device):
        attrs = self._real.CUdevice_attribute
        value = {attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
                 attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                 attrs.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132}[attribute]
        return self._ok("cuDeviceGetAttribute", value)


@pytest.fixture
def fake(monkeypatch):
    fake = CallDriver(driver.cu, current_context=0x1000, context_device=0)
    monkeypatch.setattr(driver, "cu", fake)
    monkeypatch.setattr(driver, "_initialized", False)
    monkeypatch.setattr(driver, "_primary_contexts", {})
    driver.compute_capability.cache_clear()
    driver.multiprocessor_count.cache_clear()
    maps = []

    def encode(dtype, address, dims, byte_strides, box):
        maps.append((dtype, address, dims, byte_strides, box))
        return bytes([len(maps)]) * 128

    monkeypatch.setattr(driver, "encode_tiled_tensor_map", encode)
    call._encode_tensor_map.cache_clear()
    fake.maps = maps
    yield fake
    driver.compute_capability.cache_clear()
    driver.multiprocessor_count.cache_clear()


@pytest.fixture
def bundle(tmp_path):
    fa2 = kernel_entry("sm90", KEY)
    fa3 = kernel_entry("sm90a", KEY, fa_version=3)
    fa3["launch"] = {**fa3["launch"], "grid": "persistent", "tma_q_rows": 128, "tma_kv_rows": 176}
    fa1 = kernel_entry("sm90", KEY, fa_version=1)
    fa1["launch"] = {**fa1["launch"], "block_m": 64, "grid": "heads", "workspace_floats_per_row": 130}
    return load(write_bundle(tmp_path / "b", [fa2, fa3, fa1]))


def test_prepare_picks_the_newest_kernel_and_fills_its_parameters(bundle, fake):
    prepared = prepare(bundle, PROBLEM, Q, K, V, OUT, softmax_scale=0.125)
    assert prepared.kernel.entry.fa_version == 3
    assert prepared.grid == (24, 1, 1)  # persistent: min(3 query blocks x 4 heads x 2, 132 SMs)
    p = abi.FwdParams.from_buffer_copy(prepared.params)
    assert (p.q, p.k, p.v, p.o, p.lse) == (0x10000, 0x20000, 0x30000, None, None)  # the launch fills o, lse
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (300 * 4 * 128, 4 * 128, 128)
    assert (p.k_batch_stride, p.k_row_stride, p.k_head_stride) == (500 * 128, 128, 128)
    assert (p.lse_batch_stride, p.lse_head_stride) == (4 * 300, 300)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k) == (2, 4, 1, 300, 500)
    assert abs(p.scale_log2 - 0.125 * 1.4426950408889634) < 1e-7
    # Maps over (head_dim, seqlen, heads, batch), byte strides of rows, heads, batches.
    assert fake.maps[0] == ("bf16", 0x10000, (128, 300, 4, 2), (1024, 256, 300 * 1024), (64, 128, 1, 1))
    assert fake.maps[1] == ("bf16", 0x20000, (128, 500, 1, 2), (256, 256, 500 * 256), (64, 176, 1, 1))
    assert bytes(prepared.extra_params[0]) == bytes([1]) * 128 + bytes([2]) * 128 + bytes([3]) * 128


def test_launch_fills_the_outputs_on_the_stream(bundle, fake):
    prepared = prepare(bundle, PROBLEM, Q, K, V, OUT)
    prepared.launch(out=0x40000, lse=0x50000, stream=0xABC)
    (launch,) = fake.launches
    assert (launch["params"].o, launch["params"].lse, launch["stream"]) == (0x40000, 0x50000, 0xABC)
    assert launch["grid"] == (24, 1, 1) and launch["context"] == 0x1000


def test_a_chosen_algorithm_and_its_workspace(bundle, fake):
    entry = call.select(bundle, PROBLEM, fa_version=1)
    prepared = prepare(bundle, PROBLEM, Q, K, V, OUT, entry=entry)
    assert prepared.grid == (4, 2, 1)  # (heads_q, batch): one CTA per head
    assert prepared.workspace_bytes == 4 * 130 * 300 * 4 * 2
    with pytest.raises(AttentionError, match=f"needs a workspace of {prepared.workspace_bytes} bytes"):
        prepared.launch(0x40000, 0, 0)
    seen = []
    real = fake.cuLaunchKernelEx

    def launch(config, kernel, params, extra):
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        seen.append(ctypes.c_void_p.from_address(pointers[1]).value)
        return real(config, kernel, params, extra)

    fake.cuLaunchKernelEx = launch
    prepared.launch(0x40000, 0, 0, workspace=0x60000)
    assert seen == [0x60000]  # the workspace pointer is the kernel's second parameter
    with pytest.raises(KernelNotFound, match="asked for fa_version=4"):
        call.select(bundle, PROBLEM, fa_version=4)


@pytest.mark.parametrize("change, match", [
    (dict(q=Tensor(0x10008, 300 * 512, 512, 128)), "q must be a non-null, 16-byte aligned"),
    (dict(k=Tensor(0x20000, 500 * 128, 132, 128)), r"k strides \(64000, 132, 128\) must be multiples of 8"),
    (dict(v=Tensor(0x30000, 0, 128, 128)), "non-zero \\(TMA kernel\\)"),
    (dict(out=Tensor(0, 1, 1, 1)), "out must be a non-null"),
])
def test_tensors_the_kernels_cannot_read_are_refused(bundle, fake, change, match):
    args = {"q": Q, "k": K, "v": V, "out": OUT, **change}
    with pytest.raises(AttentionError, match=match):
        prepare(bundle, PROBLEM, **args)


@pytest.mark.parametrize("problem, error, match", [
    (Problem("fp32", True, 2, 300, 500, 4, 1, 128), AttentionError, "dtype 'fp32'"),
    (Problem("bf16", True, 2, 300, 500, 4, 3, 128), AttentionError, "multiple of nheads_kv=3"),
    (Problem("bf16", True, 2, 300, 500, 4, 1, 100), AttentionError, "head_dim=100"),
    (Problem("bf16", True, 2, 300, 0, 4, 1, 128), AttentionError, "need seqlen_k >= 1"),
    (Problem("bf16", True, 70000, 300, 500, 4, 1, 128), AttentionError, "CUDA grid limit"),
    (Problem("bf16", False, 2, 300, 500, 4, 1, 128), KernelNotFound, "fwd/bf16/hd128/full"),
])
def test_calls_the_kernels_cannot_run_are_refused(bundle, fake, problem, error, match):
    with pytest.raises(error, match=match):
        prepare(bundle, problem, Q, K, V, OUT, entry=call.select(bundle, PROBLEM, fa_version=2)
                if error is AttentionError and "grid" in match else None)


def test_the_scale_rule_is_the_contracts(bundle, fake):
    with pytest.raises(ScaleError, match="must be >= 0"):
        prepare(bundle, PROBLEM, Q, K, V, OUT, softmax_scale=-1.0)


def test_an_empty_output_launches_nothing(bundle, fake):
    call.attention(bundle, Problem("bf16", True, 0, 300, 500, 4, 1, 128), Q, K, V, OUT)
    assert fake.launches == []


def test_the_runtime_call_imports_no_torch():
    code = "import sys, fagen.runtime; print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_backward_workspace_pads_the_accumulator_rows_per_head():
    # 300 query rows -> 304 accumulator rows per head (16-row fragment tiles of the FA2
    # backward); D and the base-2 LSE one float per row after it.
    from fagen import contract
    layout = contract.BackwardWorkspace.of(batch=2, heads_q=4, seqlen_q=300, head_dim=128, block_m=64)
    accum = 2 * 4 * 304 * 128
    assert (layout.dq_accum, layout.softmax_d, layout.lse_log2) == (0, accum, accum + 2 * 4 * 300)
    # then one sink partial per 16 query rows (19 for 300) per head.
    assert layout.sink_partials == accum + 2 * 2 * 4 * 300
    assert layout.floats == layout.sink_partials + 2 * 4 * 19
    assert layout.semaphores == 2 * 4 * 5
    assert contract.dq_accum_rows(16) == 16 and contract.dq_accum_rows(17) == 32


def test_a_window_selects_the_local_kernel_and_fills_its_sizes(tmp_path, fake):
    local = kernel_entry("sm90", "fwd/bf16/hd128/local")
    bundle = load(write_bundle(tmp_path / "b", [kernel_entry("sm90", KEY), local]))
    problem = dataclasses.replace(PROBLEM, causal=True, window_size=(100, -1))
    prepared = prepare(bundle, problem, Q, K, V, OUT)
    assert prepared.kernel.entry.key == "fwd/bf16/hd128/local"
    p = abi.FwdParams.from_buffer_copy(prepared.params)
    assert (p.window_left, p.window_right) == (100, 0)
    with pytest.raises(AttentionError, match=r"window_size=\(-3, 0\): each size must be >= 0"):
        prepare(bundle, dataclasses.replace(PROBLEM, window_size=(-3, 0)), Q, K, V, OUT)
    # A window as wide as the keys is no window: the causal (here: full) kernel serves it.
    assert dataclasses.replace(PROBLEM, window_size=(500, 500)).key == PROBLEM.key


@pytest.mark.parametrize("causal, window, seqlens, expected", [
    (False, (-1, -1), (10, 10), ("full", 0, 0)),
    (True, (-1, -1), (10, 10), ("causal", 0, 0)),
    (False, (-1, 0), (10, 10), ("causal", 0, 0)),
    (True, (4, 7), (10, 10), ("local", 4, 0)),
    (False, (3, 3), (10, 20), ("local", 3, 3)),
    (False, (3, -1), (10, 20), ("local", 3, 30)),
    (False, (-1, 5), (10, 20), ("local", 30, 5)),
    (False, (20, 20), (10, 20), ("full", 0, 0)),   # sizes >= seqlen_k are unbounded (flash-attn)
    (True, (18, 0), (30, 20), ("local", 18, 0)),
    # a left size >= seqlen_k - 1 reaches key 0 from the last row on: Mistral's 4095 over 4096
    (True, (19, 0), (30, 20), ("causal", 0, 0)),
    (True, (4095, 4095), (4096, 4096), ("causal", 0, 0)),
    (True, (4095, 4095), (4097, 4097), ("local", 4095, 0)),
])
def test_the_mask_rule_is_flash_attns(causal, window, seqlens, expected):
    from fagen.contract import call_mask

    mask = call_mask(causal, window, *seqlens)
    assert (mask.kind, mask.window_left, mask.window_right) == expected


def test_a_key_takes_a_mask_kind_not_a_flag():
    from fagen import contract

    assert contract.kernel_key("bwd", "fp16", 64, "local") == "bwd/fp16/hd64/local"
    with pytest.raises(ValueError, match="mask=True: one of full, causal, local"):
        contract.kernel_key("fwd", "bf16", 128, True)


@pytest.mark.parametrize("mods", [(), ("softcap",), ("alibi", "sinks"), ("softcap", "alibi", "sinks")])
@pytest.mark.parametrize("mask", ("full", "causal", "local"))
def test_a_key_spells_the_variant_and_parses_back(mask, mods):
    from fagen import contract

    key = contract.kernel_key("fwd", "bf16", 128, mask, mods)
    assert key == f"fwd/bf16/hd128/{mask}" + "".join(f"+{m}" for m in mods)
    assert contract.KernelKey.parse(key) == contract.KernelKey("fwd", "bf16", 128, mask, mods)
    # One spelling: the modifiers in SCORE_MODS order, each once, after a mask.
    assert contract.KernelKey.parse(f"fwd/bf16/hd128/{mask}+sinks+softcap") is None
    assert contract.KernelKey.parse("fwd/bf16/hd128/softcap") is None
    with pytest.raises(ValueError, match="score modifiers"):
        contract.kernel_key("fwd", "bf16", 128, mask, ("tanh",))


def test_a_key_spells_split_head_dims_once_each():
    from fagen import contract

    key = contract.kernel_key("bwd", "bf16", 192, "causal", (), 128)
    assert key == "bwd/bf16/hd192v128/causal"
    assert contract.KernelKey.parse(key) == contract.KernelKey("bwd", "bf16", 192, "causal", (), 128)
    # One head dim is spelled once, however it is given.
    assert contract.kernel_key("fwd", "bf16", 128, "full", (), 128) == "fwd/bf16/hd128/full"
    assert contract.KernelKey("fwd", "bf16", 128, "full", (), 128).head_dim_v is None
    assert contract.KernelKey.parse("fwd/bf16/hd128v128/full") is None
    assert contract.KernelKey.parse("fwd/bf16/hd128v/full") is None


def test_the_score_rule():
    from fagen import contract

    assert contract.Score().mods == () and contract.Score(30.0, True, True).mods == contract.SCORE_MODS
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(contract.ScoreError, match="softcap"):
            contract.Score(bad)
    plain = contract.kernel_score_scale(0.125, 64)
    assert plain == contract.KernelScale(contract.kernel_scale_log2(0.125, 64), 0.0)
    capped = contract.kernel_score_scale(0.125, 64, 50.0)
    assert capped.scale_log2 == pytest.approx(50.0 * contract.LOG2_E) and capped.softcap_scale == 0.125 / 50.0
    assert contract.kernel_score_scale(None, 64, 10.0).softcap_scale == pytest.approx(1 / 8 / 10)
    with pytest.raises(contract.ScaleError):
        contract.kernel_score_scale(-1.0, 64, 10.0)


def test_score_arrays_are_checked_before_a_launch():
    from fagen import contract
    from fagen.runtime import call

    problem = call.Problem("bf16", True, 2, 4, 4, 4, 4, 128, score=contract.Score(alibi=True, sinks=True))
    with pytest.raises(call.AttentionError, match="alibi_slopes: a non-null"):
        call._check_score_tensors(problem, call.ScoreTensors(sinks=64))
    with pytest.raises(call.AttentionError, match="sinks: a non-null, 4-byte aligned"):
        call._check_score_tensors(problem, call.ScoreTensors(alibi_slopes=64, sinks=66))
    with pytest.raises(call.AttentionError, match="batch stride 3"):
        call._check_score_tensors(problem, call.ScoreTensors(alibi_slopes=64, alibi_batch_stride=3, sinks=64))
    with pytest.raises(call.AttentionError, match="dsinks"):
        call._check_score_tensors(problem, call.ScoreTensors(alibi_slopes=64, sinks=64), backward=True)
    call._check_score_tensors(problem, call.ScoreTensors(alibi_slopes=64, alibi_batch_stride=4, sinks=64, dsinks=64),
                              backward=True)


def test_a_custom_mask_is_keyed_by_its_name_and_replaces_causal():
    from fagen import contract
    from fagen.runtime.call import AttentionError, Problem, check_problem

    problem = Problem("bf16", False, 1, 64, 64, 2, 2, 128, mask_mod="document")
    assert problem.key == "fwd/bf16/hd128/document" and problem.mask.window_left == 0
    assert contract.KernelKey.parse("bwd/bf16/hd64/doc_2+sinks") == contract.KernelKey("bwd", "bf16", 64, "doc_2", ("sinks",))
    assert contract.KernelKey.parse("fwd/bf16/hd64/custom") is None  # the kind, not a name
    with pytest.raises(AttentionError, match="replaces causal and window_size"):
        check_problem(Problem("bf16", True, 1, 64, 64, 2, 2, 128, mask_mod="document"))
    with pytest.raises(AttentionError, match="lower-case letters"):
        check_problem(Problem("bf16", False, 1, 64, 64, 2, 2, 128, mask_mod="Doc"))


# ---- the backward prepared once (fagen.runtime.prepared) ----

def backward_entry(key: str, fa_version: int) -> dict:
    """A backward kernel of `key` for the 9.0 device: FA3 (sm90a) maps its tensors (TMA), FA2
    (sm90) does not; both on a grid of 128-key blocks."""
    direction, dtype, head_dim, variant = key.split("/", 3)
    entry = kernel_entry("sm90a" if fa_version == 3 else "sm90",
                         f"{direction}/{dtype}/{head_dim}/{variant.replace('/', '_').replace('+', '_')}",
                         fa_version=fa_version)
    entry["key"] = key
    entry["launch"] = {**entry["launch"], "block_m": 64, "block_n": 128, "grid": "key_blocks",
                       **({"threads": 384, "tma_q_rows": 64, "tma_kv_rows": 128} if fa_version == 3 else {})}
    return entry


BACKWARD_CASES = {  # problem, varlen's (total_q, total_k) or None
    "causal-gqa-odd": (Problem("bf16", True, 2, 301, 499, 4, 2, 128), None),
    "full-mha": (Problem("bf16", False, 1, 256, 256, 2, 2, 128), None),
    "alibi-sinks-mqa": (Problem("bf16", True, 3, 77, 1000, 8, 1, 128, score=contract.Score(alibi=True, sinks=True)),
                        None),
    "varlen": (Problem("bf16", True, 3, 200, 300, 4, 2, 128, layout="varlen"), (450, 700)),
}


@pytest.fixture
def backward_bundle(tmp_path):
    return load(write_bundle(tmp_path / "b", [backward_entry(problem.direction_key("bwd"), fa_version)
                                              for problem, _ in BACKWARD_CASES.values() for fa_version in (2, 3)]))


@pytest.fixture
def launched(monkeypatch):
    """Every launch as (kernel, grid, block, dynamic shared memory, stream, its parameters' bytes)."""
    recorded = []

    def launch(kernel, grid, block, dynamic_smem, stream, params):
        recorded.append((int(kernel), grid, block, dynamic_smem, stream, tuple(bytes(p) for p in params)))

    monkeypatch.setattr(driver, "launch", launch)
    return recorded


def _backward_call(problem: Problem, totals: tuple[int, int] | None, base: int, deterministic: bool = False) -> dict:
    """attention_backward's arguments for `problem`, every buffer at its own address from `base` up."""
    def at(index):
        return base + (index << 24)

    rows_q, rows_k = (problem.seqlen_q, problem.seqlen_k) if totals is None else totals

    def like_q(index):
        return Tensor.contiguous(at(index), rows_q, problem.heads_q, problem.head_dim)

    def like_k(index):
        return Tensor.contiguous(at(index), rows_k, problem.heads_kv, problem.head_dim)

    tensors = call.BackwardTensors(q=like_q(0), k=like_k(1), v=like_k(2), out=like_q(3), dout=like_q(4), dq=like_q(5),
                                   dk=like_k(6), dv=like_k(7), lse=at(8))
    score = problem.score
    arrays = call.ScoreTensors(alibi_slopes=at(9) if score.alibi else 0, sinks=at(10) if score.sinks else 0,
                               dsinks=at(11) if score.sinks else 0)
    return dict(tensors=tensors, workspace=at(12), semaphores=at(13) if deterministic else 0, score_tensors=arrays,
                varlen=None if totals is None else call.Varlen(at(14), at(15), *totals))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("fa_version", [2, 3])
@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_a_prepared_backward_launches_what_attention_backward_does(backward_bundle, fake, launched, case, fa_version,
                                                                   deterministic):
    problem, totals = BACKWARD_CASES[case]
    entry = call.select_backward(backward_bundle, problem, fa_version=fa_version)
    prepared_on, launched_on = (_backward_call(problem, totals, base, deterministic) for base in (1 << 32, 2 << 32))
    prepared = prepare_backward(backward_bundle, problem, prepared_on["tensors"], deterministic=deterministic,
                                softmax_scale=0.1, entry=entry, score_tensors=prepared_on["score_tensors"],
                                varlen=prepared_on["varlen"])
    tensors = launched_on.pop("tensors")
    prepared.launch(BackwardPointers.of(tensors), stream=0xABC, **launched_on)
    call.attention_backward(backward_bundle, problem, tensors, softmax_scale=0.1, stream=0xABC, entry=entry,
                            **launched_on)
    assert len(launched) == 6 and launched[:3] == launched[3:], "not the unprepared call's launched"
    assert len({launch[0] for launch in launched[:3]}) == 3  # the preprocess, the main kernel, the dQ conversion
    main = launched[1][-1]
    params = abi.BwdParams.from_buffer_copy(main[0])
    addresses = [getattr(params, name) for name, kind in abi.BwdParams._fields_ if kind is ctypes.c_void_p]
    assert all(address is None or address >= 2 << 32 for address in addresses), "an address of the prepared call"
    if fa_version == 3:  # the maps over the launch's q, k, v, dout and dQ accumulator (fake: map n is n's bytes)
        mapped = [fake.maps[main[1][128 * i] - 1][1] for i in range(5)]
        assert mapped == [tensors.q.data, tensors.k.data, tensors.v.data, tensors.dout.data, launched_on["workspace"]]
    else:
        assert len(main) == 1


def test_a_prepared_backward_maps_each_set_of_addresses_once(backward_bundle, fake, launched):
    problem, _ = BACKWARD_CASES["causal-gqa-odd"]
    arguments = _backward_call(problem, None, 1 << 32)
    prepared = prepare_backward(backward_bundle, problem, arguments.pop("tensors"))
    first, second = (BackwardPointers.of(_backward_call(problem, None, base)["tensors"]) for base in (2 << 32, 3 << 32))
    for pointers in (first, first, second, first):
        prepared.launch(pointers, **arguments)
    # Five maps for the first set, four for the second (the same workspace: its map is the first's).
    assert len(fake.maps) == 9 and launched[1] == launched[4] == launched[10] != launched[7]
    prepared.launch(first, **dict(arguments, workspace=4 << 32))  # the dQ accumulator's map moves with it
    assert fake.maps[-1][1] == 4 << 32 and launched[-2][-1][1][-128:] == bytes([10]) * 128


def test_a_prepared_backward_refuses_launches_it_was_not_prepared_for(backward_bundle, fake, launched):
    problem, _ = BACKWARD_CASES["causal-gqa-odd"]
    arguments = _backward_call(problem, None, 1 << 32)
    pointers = BackwardPointers.of(arguments["tensors"])
    prepared = prepare_backward(backward_bundle, problem, arguments["tensors"])
    with pytest.raises(AttentionError, match="needs a workspace"):
        prepared.launch(pointers, workspace=0)
    with pytest.raises(AttentionError, match="semaphores are the deterministic mode's"):
        prepared.launch(pointers, workspace=1 << 20, semaphores=2 << 20)
    with pytest.raises(AttentionError, match="a dense one without"):
        prepared.launch(pointers, workspace=1 << 20, varlen=call.Varlen(3 << 20, 4 << 20, 301, 499))
    assert launched == []
