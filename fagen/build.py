"""Build a bundle: render every spec, compile (cached, in parallel), check the resources and
SASS, and hand the results to the bundle writer (fagen/bundle/writer.py).

The orchestration of the pipeline stages (spec -> codegen -> compiler -> bundle), kept out of
each of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from . import paths
from ._version import __version__
from .bundle.format import Manifest, sha256_bytes
from .bundle.writer import BundleWriter
from .codegen import RenderedKernel, render
from .compiler import (
    CachedKernel, CompiledKernel, CompileError, KernelCache, NvrtcOptions, PtxasResources,
    cache_root, compile_kernel, compiler_versions, options_for, sass_families_of, sass_problems,
    toolchain_versions, tree_digest,
)
from .contract import KernelEntry, Resources
from .model import ARCHS, Arch, Expansion, KernelSpec

_PACKAGE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class KernelBuild:
    name: str
    arch: str
    resources: PtxasResources
    cubin_size: int
    seconds: float  # compile time; for a cache hit, the time of the compile that filled it
    cached: bool


@dataclass(frozen=True)
class BuildReport:
    bundle_dir: Path
    manifest: Manifest
    kernels: tuple[KernelBuild, ...]
    skipped: tuple[dict, ...]
    seconds: float

    @property
    def compiled(self) -> int:
        return sum(not k.cached for k in self.kernels)


ProgressCallback = Callable[[KernelBuild, int, int], None]


def fingerprint(options: dict[Arch, NvrtcOptions], toolchain: dict[str, str]) -> str:
    """sha256 over every input that decides a cubin besides the spec file: the templates, the
    Python that computes what they receive (the kernel models, codegen, the contract and the ABI),
    fagen's version, the toolchain and the flags.

    Equal fingerprints mean equal inputs apart from the spec file: a consumer can tell whether two
    bundles were produced by the same compiler.
    """
    inputs = {
        "templates": tree_digest(paths.templates_dir()),
        "model": tree_digest(_PACKAGE / "model"),
        "codegen": tree_digest(_PACKAGE / "codegen"),
        "contract": sha256_bytes((_PACKAGE / "contract.py").read_bytes()),
        "abi": sha256_bytes((_PACKAGE / "abi.py").read_bytes()),
        "fagen": __version__,
        "toolchain": toolchain,
        "flags": {arch.value: list(opts.flags) for arch, opts in sorted(options.items())},
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _skipped_records(expansion: Expansion) -> tuple[dict, ...]:
    return tuple(
        {"entry": index, "fields": fields, "why": why} for index, fields, why in expansion.skipped
    )


def _build_one(
    rendered: RenderedKernel, source_dir: Path, options: NvrtcOptions, cache: KernelCache
) -> tuple[CachedKernel | CompiledKernel, bool]:
    """(the cached kernel, True) on a cache hit; else (the compiled kernel, False), whose SASS
    _check_sass still has to read before it is cached."""
    key = cache.key(rendered, options)
    if (hit := cache.get(key)) is not None:
        return hit, True
    return compile_kernel(rendered, source_dir, options), False


# How many compiled kernels of one target share one nvdisasm call (fagen.compiler.sass: its start-up
# costs more than decoding a kernel); fewer wait for the last batch at the end of a build.
SASS_BATCH = 8


def _check_sass(
    batch: Sequence[tuple[RenderedKernel, CompiledKernel]], staging: Path,
    options: NvrtcOptions, cache: KernelCache,
) -> list[CachedKernel]:
    """Read the SASS families of compiled kernels of one target, refuse those that lack their
    algorithm's families or use local memory, and cache the others; in `batch` order."""
    target = ARCHS[batch[0][0].spec.arch].nvrtc_arch
    families_of = sass_families_of([c.cubin for _, c in batch], target)
    kernels = []
    for (rendered, compiled), found in zip(batch, families_of):
        families = tuple(sorted(found))
        if problems := sass_problems(set(families), rendered.spec.required_sass):
            raise CompileError(
                f"{rendered.name}: " + "; ".join(problems) + f" (SASS families: {', '.join(families)})",
                compiled.log, staging / "src" / rendered.spec.arch.value / f"{rendered.name}.cu",
            )
        kernel = CachedKernel(compiled.cubin, compiled.resources, families, compiled.seconds)
        cache.put(cache.key(rendered, options), kernel)
        kernels.append(kernel)
    return kernels


def _expected_seconds(spec: KernelSpec) -> float:
    """A rough compile time, only to start the slow compiles first (so that no long one is left
    running alone at the end): per-kernel means of a cold default build on 2 cores (2026-12-02,
    NVRTC 13.5): FA3 backward 1.2 s, FA3 forward 0.8, FA2 backward 0.7, FA2 forward 0.5; larger
    head dims take longer."""
    base = {(3, "bwd"): 1.2, (3, "fwd"): 0.8, (2, "bwd"): 0.7, (2, "fwd"): 0.5}
    return base.get((spec.fa_version, spec.direction), 1.0) * (0.75 + spec.head_dim / 512)


def _entry(spec: KernelSpec, kernel: CachedKernel) -> KernelEntry:
    arch = spec.arch.value
    info = ARCHS[spec.arch]
    r = kernel.resources
    return KernelEntry(
        name=spec.name,
        key=spec.lookup_key,
        arch=arch,
        compute_capability=tuple(info.compute_capability),
        arch_specific=info.arch_specific,
        fa_version=spec.fa_version,
        spec=spec.model_dump(mode="json"),
        cubin=f"cubin/{arch}/{spec.name}.cubin",
        source=f"src/{arch}/{spec.name}.cu",
        sha256=sha256_bytes(kernel.cubin),
        size=len(kernel.cubin),
        launch=spec.launch(),
        resources=Resources(registers=r.registers, spill_bytes=r.spill_bytes,
                            stack_bytes=r.stack_bytes, static_smem=r.static_smem),
        sass=kernel.sass,
        max_seqlen_k=spec.max_seqlen_k,
    )


def _kernel_build(spec: KernelSpec, kernel: CachedKernel, cached: bool) -> KernelBuild:
    return KernelBuild(spec.name, spec.arch.value, kernel.resources, len(kernel.cubin),
                       kernel.seconds, cached)


def _compile_all(
    rendered: list[RenderedKernel], options: dict[Arch, NvrtcOptions], staging: Path, jobs: int,
    cache: KernelCache, progress: ProgressCallback | None, order: Sequence[int] | None = None,
) -> list[tuple[CachedKernel, bool]]:
    """(kernel, came from the cache) per rendered kernel, in order; the first failure raises.

    `jobs` tasks run at a time and nothing waits in the pool's queue: compiles in `order`
    (default: as given), and SASS checks of up to SASS_BATCH compiled kernels of one target,
    which start before the next compile once a batch is full or no compile is left to start.
    """
    results: list[tuple[CachedKernel, bool] | None] = [None] * len(rendered)
    to_compile = deque(range(len(rendered)) if order is None else order)
    unchecked: dict[Arch, list[tuple[int, CompiledKernel]]] = {}  # compiled, SASS not read yet
    running: dict[Future, tuple[str, object]] = {}
    workers = max(1, jobs)

    def finished(index: int, kernel: CachedKernel, cached: bool) -> None:
        results[index] = (kernel, cached)
        if progress is not None:
            progress(_kernel_build(rendered[index].spec, kernel, cached),
                     sum(r is not None for r in results), len(rendered))

    def submit_next(pool: ThreadPoolExecutor) -> bool:
        for arch, waiting in unchecked.items():
            if len(waiting) >= SASS_BATCH or (waiting and not to_compile):
                batch, unchecked[arch] = waiting[:SASS_BATCH], waiting[SASS_BATCH:]
                items = [(rendered[i], kernel) for i, kernel in batch]
                future = pool.submit(_check_sass, items, staging, options[arch], cache)
                running[future] = ("sass", [i for i, _ in batch])
                return True
        if to_compile:
            index = to_compile.popleft()
            r = rendered[index]
            future = pool.submit(_build_one, r, staging / "src" / r.spec.arch.value,
                                 options[r.spec.arch], cache)
            running[future] = ("compile", index)
            return True
        return False

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fagen-nvrtc") as pool:
        try:
            while True:
                while len(running) < workers and submit_next(pool):
                    pass
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    kind, what = running.pop(future)
                    if future.exception() is not None:
                        raise future.exception()
                    if kind == "sass":
                        for index, kernel in zip(what, future.result()):
                            finished(index, kernel, False)
                        continue
                    kernel, cached = future.result()
                    if cached:
                        finished(what, kernel, True)
                    else:
                        unchecked.setdefault(rendered[what].spec.arch, []).append((what, kernel))
        except BaseException:
            # A failure or Ctrl-C (KeyboardInterrupt reaches this thread, inside wait()): drop
            # what is queued, so that leaving the pool waits only for the tasks already running
            # (an NVRTC call cannot be stopped halfway; letting it end leaves no temporary files).
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return results


def _in_failed_dir(exc: CompileError, staging: Path, failed_dir: Path) -> CompileError:
    """The error, naming its source where the failed build keeps it."""
    if exc.source_path is None:
        return exc
    try:
        return exc.with_source_path(failed_dir / Path(exc.source_path).relative_to(staging))
    except ValueError:
        return exc


def build_bundle(
    expansion: Expansion,
    out_dir: Path,
    jobs: int = os.cpu_count() or 1,
    progress: ProgressCallback | None = None,
    cache_dir: Path | None = None,
) -> BuildReport:
    """Compile every spec of `expansion` into the bundle at `out_dir`, replacing it atomically.

    Raises CompileError for a kernel that does not compile or fails its checks (spills, missing
    SASS families, local memory; its sources are kept in `<out>.failed/`), RenderError for a
    template problem, FileExistsError when `out_dir` holds something that is not a bundle.
    """
    start = time.perf_counter()
    toolchain = toolchain_versions()
    cache = KernelCache(cache_dir or cache_root(), compiler_versions(), paths.include_dir())
    with BundleWriter(out_dir) as writer:
        rendered = [render(spec) for spec in expansion.specs]
        for r in rendered:
            writer.write(f"src/{r.spec.arch.value}/{r.name}.cu", r.source)
        options = {arch: options_for(arch) for arch in {r.spec.arch for r in rendered}}
        try:
            # The slow compiles first: a long one started last would run alone at the end.
            order = sorted(range(len(rendered)),
                           key=lambda i: -_expected_seconds(rendered[i].spec))
            built = _compile_all(rendered, options, writer.staging, jobs, cache, progress, order)
        except CompileError as exc:
            staging = writer.keep_failed()
            raise _in_failed_dir(exc, staging, writer.failed_dir) from None
        entries = []
        for r, (kernel, _) in zip(rendered, built):
            entry = _entry(r.spec, kernel)
            writer.write(entry.cubin, kernel.cubin)
            entries.append(entry)
        manifest = Manifest(
            bundle=expansion.bundle,
            fingerprint=fingerprint(options, toolchain),
            toolchain=dict(toolchain),
            kernels=tuple(entries),
            skipped=_skipped_records(expansion),
        )
        writer.commit(manifest)
    return BuildReport(
        bundle_dir=writer.out_dir,
        manifest=manifest,
        kernels=tuple(
            _kernel_build(r.spec, kernel, cached) for r, (kernel, cached) in zip(rendered, built)
        ),
        skipped=manifest.skipped,
        seconds=time.perf_counter() - start,
    )
