"""A seeded randomised differential test of the forward and backward against the fp64 reference.

Each case draws a whole call at random: batch, seqlen_q and seqlen_k (1, a few, one past a tile,
one much larger than the other), head dim, GQA ratio, dtype, causal, deterministic, softmax_scale,
the size of q and k (x1 to x16, sometimes with outliers x100), the layout (contiguous, a
transposed view, sliced heads), which inputs need gradients and, where the bundle has local
kernels, a sliding window in a quarter of the cases (drawn last, from a generator of its own, so
that the other fields of a seed are what they were before windows); then, where the bundle has
the variant, score modifiers (softcap, ALiBi, sinks, alone or together) in a quarter of the cases
(`--differential-score-share`; from a generator of their own too). Outputs and gradients (the sink's too) are
poisoned before their launches; the rules are attention_reference's (2x / 3x, everything
finite).

A quick pass runs in every GPU run (`--differential-cases`, default 150, within
`--differential-seconds`, default 120); the long pass is `--differential-cases 5000`. Cases are
numbered from `--differential-seed` (default 0), so a pass is the same on every run. A failing
case is printed as one line that replays it, after shrinking it to a smallest shape that still
fails (a few dozen calls at most):

    FAGEN_DIFFERENTIAL_CASE='{...}' python -m pytest tests/gpu/test_differential.py -k replay
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time

import pytest

torch = pytest.importorskip("torch")

from attention_reference import (  # noqa: E402
    Mods, failures_of, forward_errors, geometric_alibi_slopes, gradient_errors,
)
from test_fa2_fwd import DTYPE_BY_NAME, poison_allocator  # noqa: E402
from fagen import contract  # noqa: E402
from fagen.torch import KernelNotFound, flash_attn_func  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYOUTS = ("contiguous", "transposed", "sliced_heads")
# Sequence lengths by kind: the tiles are 64 or 128 rows / keys, 176 in some FA3 forwards.
TILE_EDGES = (63, 64, 65, 127, 128, 129, 176, 177, 255, 257)


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_kv: int
    group: int
    head_dim: int
    dtype: str
    causal: bool
    deterministic: bool
    softmax_scale: float | None
    magnitude: float
    outliers: bool
    layout: str
    grads: str  # "qkv" or "q": which inputs need gradients
    window: tuple[int, int] = (-1, -1)  # flash-attn's window_size
    score: str = ""  # the score modifiers, "+"-joined (contract.SCORE_MODS)
    softcap: float = 0.0

    def line(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    def replay(self) -> str:
        return f"FAGEN_DIFFERENTIAL_CASE='{self.line()}' python -m pytest tests/gpu/test_differential.py -k replay"


def draw_seqlen(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.15:
        return 1
    if kind < 0.35:
        return rng.randint(2, 8)
    if kind < 0.6:
        return rng.choice(TILE_EDGES)
    return rng.randint(9, 700)


def draw_window(rng: random.Random, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """A window: each side unbounded, 0, a few keys, about a tile, or a fraction of the keys."""
    def side():
        kind = rng.random()
        if kind < 0.2:
            return -1
        if kind < 0.35:
            return 0
        if kind < 0.55:
            return rng.randint(1, 8)
        if kind < 0.75:
            return rng.choice(TILE_EDGES)
        return rng.randint(0, max(seqlen_q, seqlen_k))
    window = (side(), side())
    return window if window != (-1, -1) else (rng.randint(0, 300), -1)


# The score modifiers a case may draw (a kernel variant each).
SCORE_CHOICES = (("softcap",), ("alibi",), ("sinks",), ("softcap", "sinks"), ("softcap", "alibi", "sinks"))


def draw_case(seed: int, head_dims: dict[tuple[str, bool], list[int]],
              local: frozenset[tuple[str, int]] = frozenset(),
              variants: frozenset[tuple[str, int, str, tuple[str, ...]]] = frozenset(),
              score_share: float = 0.25) -> Case:
    rng = random.Random(seed)
    dtype, causal = rng.choice(sorted(head_dims))
    seqlen_q, seqlen_k = draw_seqlen(rng), draw_seqlen(rng)
    if rng.random() < 0.15:  # one much longer than the other
        if rng.random() < 0.5:
            seqlen_q = rng.randint(8, 40) * max(1, seqlen_k)
        else:
            seqlen_k = rng.randint(8, 40) * max(1, seqlen_q)
        seqlen_q, seqlen_k = min(seqlen_q, 3000), min(seqlen_k, 3000)
    heads_kv, group = rng.choice((1, 2, 3)), rng.choice((1, 1, 2, 4, 8))
    magnitude = rng.choice((1.0, 1.0, 2.0, 4.0, 8.0, 16.0))
    kind = rng.random()
    scale = None if kind < 0.6 else (0.0 if kind < 0.63 else round(math.exp(rng.uniform(math.log(0.02), math.log(2.0))), 4))
    case = Case(
        seed=seed, batch=rng.randint(1, 3), seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_kv=heads_kv,
        group=group, head_dim=rng.choice(head_dims[(dtype, causal)]), dtype=dtype, causal=causal,
        deterministic=rng.random() < 0.2, softmax_scale=scale, magnitude=magnitude,
        outliers=rng.random() < 0.15, layout=rng.choice(LAYOUTS), grads="qkv" if rng.random() < 0.85 else "q")
    windows = random.Random(f"window {seed}")
    if (dtype, case.head_dim) in local and windows.random() < 0.25:
        case = dataclasses.replace(case, window=draw_window(windows, seqlen_q, seqlen_k))
    scores = random.Random(f"score {seed}")
    if scores.random() < score_share:
        mods = scores.choice(SCORE_CHOICES)
        kind = contract.call_mask(case.causal, case.window, seqlen_q, seqlen_k).kind
        if (dtype, case.head_dim, kind, mods) in variants:
            softcap = scores.choice((5.0, 30.0, 50.0)) if "softcap" in mods else 0.0
            case = dataclasses.replace(case, score="+".join(mods), softcap=softcap)
    return case


def score_mods(case: Case, heads_q: int, gen: torch.Generator) -> Mods:
    """The case's modifiers: ALiBi's geometric slopes times a random factor each, per (batch, head)
    in odd seeds; sinks of the size of the scores (x magnitude^2), either sign."""
    mods = case.score.split("+") if case.score else []
    alibi = sink = None
    if "alibi" in mods:
        shape = (case.batch, heads_q) if case.seed % 2 else (heads_q,)
        alibi = geometric_alibi_slopes(heads_q, "cuda") * (0.5 + torch.rand(shape, generator=gen, device="cuda"))
    if "sinks" in mods:
        sink = torch.randn(heads_q, generator=gen, device="cuda") * 3 * case.magnitude ** 2
    return Mods(softcap=case.softcap, alibi=alibi, sink=sink)


def make_input(case: Case, seqlen: int, heads: int, gen: torch.Generator, magnitude: float) -> torch.Tensor:
    """A random (batch, seqlen, heads, head_dim) tensor in the case's layout and dtype."""
    shape = (case.batch, seqlen, heads, case.head_dim)
    values = torch.randn(shape, generator=gen, device="cuda") * magnitude
    if case.outliers:  # about one value in a thousand, x100
        index = torch.randint(0, values.numel(), (max(1, values.numel() // 1000),), generator=gen, device="cuda")
        values = values * torch.ones(values.numel(), device="cuda").index_fill_(0, index, 100.0).view(shape)
    dtype = DTYPE_BY_NAME[case.dtype]
    if case.layout == "transposed":
        out = torch.empty(case.batch, heads, seqlen, case.head_dim, dtype=dtype, device="cuda").transpose(1, 2)
    elif case.layout == "sliced_heads":
        out = torch.empty(case.batch, seqlen, heads + 2, case.head_dim, dtype=dtype, device="cuda")[:, :, 1:1 + heads]
    else:
        out = torch.empty(shape, dtype=dtype, device="cuda")
    return out.copy_(values)


def run_case(case: Case, bundle) -> list[str]:
    """The case's failures (empty: it passes)."""
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    heads_q = case.heads_kv * case.group
    q = make_input(case, case.seqlen_q, heads_q, gen, case.magnitude)
    k = make_input(case, case.seqlen_k, case.heads_kv, gen, case.magnitude)
    v = make_input(case, case.seqlen_k, case.heads_kv, gen, 1.0)
    dout = torch.randn(case.batch, case.seqlen_q, heads_q, case.head_dim, generator=gen, device="cuda").to(q.dtype)
    q.requires_grad_(True)
    if case.grads == "qkv":
        k.requires_grad_(True)
        v.requires_grad_(True)
    window = tuple(case.window)
    mods = score_mods(case, heads_q, gen)
    sink = None if mods.sink is None else mods.sink.clone().requires_grad_(True)
    kwargs = dict(causal=case.causal, window_size=window, softmax_scale=case.softmax_scale,
                  softcap=mods.softcap, alibi_slopes=mods.alibi, learnable_sink=sink,
                  deterministic=case.deterministic, bundle=bundle)
    poison_allocator((q.shape, q.dtype), ((case.batch, heads_q, case.seqlen_q), torch.float32))
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kwargs)
    torch.cuda.synchronize()
    errors = forward_errors(out.detach(), lse, q.detach(), k.detach(), v.detach(), case.causal, case.softmax_scale,
                            window, mods)
    inputs = [t for t in (q, k, v) if t.requires_grad]
    poison_allocator(*((t.shape, t.dtype) for t in inputs))
    got = torch.autograd.grad(out, inputs + ([sink] if sink is not None else []), dout)
    torch.cuda.synchronize()
    grads = list(got[:len(inputs)]) + [None] * (3 - len(inputs)) + list(got[len(inputs):])
    errors.update(gradient_errors(grads, q.detach(), k.detach(), v.detach(), dout, case.causal, case.softmax_scale,
                                  out.detach(), window, mods))
    log = os.environ.get("FAGEN_DIFFERENTIAL_LOG")
    if log:  # every case's errors, one JSON line each: the data behind the rule's margins
        with open(log, "a") as f:
            f.write(json.dumps({"case": dataclasses.asdict(case), "errors": errors}) + "\n")
    return failures_of(errors)


def smaller(case: Case):
    """Cases one step smaller than `case`, the most promising first."""
    for field, value in (("batch", 1), ("group", 1), ("heads_kv", 1)):
        if getattr(case, field) > value:
            yield dataclasses.replace(case, **{field: value})
    for field in ("seqlen_q", "seqlen_k"):
        n = getattr(case, field)
        for m in sorted({n // 2, n - 1, 1}):
            if 1 <= m < n:
                yield dataclasses.replace(case, **{field: m})
    if case.layout != "contiguous":
        yield dataclasses.replace(case, layout="contiguous")
    if case.deterministic:
        yield dataclasses.replace(case, deterministic=False)


def shrink(case: Case, failures: list[str], bundle, budget: int = 40) -> tuple[Case, list[str]]:
    """A smallest case that still fails (`case` fails with `failures`), found greedily in at most
    `budget` calls."""
    progress = True
    while progress and budget > 0:
        progress = False
        for candidate in smaller(case):
            budget -= 1
            found = run_case(candidate, bundle)
            if found:
                case, failures, progress = candidate, found, True
                break
            if budget <= 0:
                break
    return case, failures


def _has_kernels(bundle, dtype: str, head_dim: int, mask: str, mods: tuple[str, ...] = ()) -> bool:
    """Whether the bundle has a forward and a backward kernel of `mask` (and `mods`) for this device."""
    try:
        for direction in ("fwd", "bwd"):
            bundle.select(contract.kernel_key(direction, dtype, head_dim, mask, mods),
                          torch.cuda.get_device_capability())
    except KernelNotFound:
        return False
    return True


def head_dims_of(bundle) -> dict[tuple[str, bool], list[int]]:
    """Per (dtype, causal), the head dims with a forward and a backward kernel for this device."""
    found: dict[tuple[str, bool], list[int]] = {}
    for dtype in DTYPE_BY_NAME:
        for causal in (False, True):
            for head_dim in (64, 96, 128, 192, 256):
                if _has_kernels(bundle, dtype, head_dim, "causal" if causal else "full"):
                    found.setdefault((dtype, causal), []).append(head_dim)
    return found


def local_of(bundle) -> frozenset[tuple[str, int]]:
    """The (dtype, head_dim) pairs with local (sliding-window) kernels for this device."""
    return frozenset((dtype, head_dim) for dtype in DTYPE_BY_NAME for head_dim in (64, 96, 128, 192, 256)
                     if _has_kernels(bundle, dtype, head_dim, "local"))


def variants_of(bundle) -> frozenset[tuple[str, int, str, tuple[str, ...]]]:
    """The (dtype, head_dim, mask, score modifiers) of SCORE_CHOICES with kernels for this device."""
    return frozenset((dtype, head_dim, mask, mods) for dtype in DTYPE_BY_NAME for head_dim in (64, 96, 128, 192, 256)
                     for mask in contract.MASKS for mods in SCORE_CHOICES
                     if _has_kernels(bundle, dtype, head_dim, mask, mods))


def test_randomized_differential(bundle, request):
    cases = request.config.getoption("--differential-cases")
    seconds = request.config.getoption("--differential-seconds")
    first = request.config.getoption("--differential-seed")
    head_dims, local, variants = head_dims_of(bundle), local_of(bundle), variants_of(bundle)
    if not head_dims:
        pytest.skip("the bundle has no forward + backward kernels for this device")
    start, ran, failed = time.monotonic(), 0, []
    for seed in range(first, first + cases):
        if time.monotonic() - start > seconds:
            break
        case = draw_case(seed, head_dims, local, variants, request.config.getoption("--differential-score-share"))
        ran += 1
        failures = run_case(case, bundle)
        if failures:
            failed.append((case, failures))
    report = [f"{ran} cases from seed {first} in {time.monotonic() - start:.0f} s, {len(failed)} failed"]
    for case, failures in failed[:3]:  # shrinking costs calls: the first few
        small, small_failures = shrink(case, failures, bundle)
        report.append(f"case {case.seed}: {'; '.join(failures)}\n  shrunk: {'; '.join(small_failures)}\n"
                      f"  {small.replay()}")
    for case, failures in failed[3:]:
        report.append(f"case {case.seed}: {'; '.join(failures)}\n  {case.replay()}")
    print("\n".join(report))
    assert not failed, "\n".join(report)


def test_replay(bundle):
    line = os.environ.get("FAGEN_DIFFERENTIAL_CASE")
    if not line:
        pytest.skip("set FAGEN_DIFFERENTIAL_CASE to a case's one-line form")
    case = Case(**json.loads(line))
    failures = run_case(case, bundle)
    assert not failures, "; ".join(failures)
