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
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from . import paths
from ._version import __version__
from .bundle.format import Manifest, sha256_bytes
from .bundle.writer import BundleWriter
from .codegen import RenderedKernel, render
from .compiler import (
    CachedKernel, CompileError, KernelCache, NvrtcOptions, PtxasResources, cache_root,
    compile_kernel, compiler_versions, options_for, sass_families, sass_problems,
    toolchain_versions, tree_digest,
)
from .contract import KernelEntry, Resources
from .spec import ARCHS, Arch, Expansion, KernelSpec

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
    Python that computes what they receive (spec models, codegen, the contract and the ABI),
    fagen's version, the toolchain and the flags.

    Equal fingerprints mean equal inputs apart from the spec file: a consumer can tell whether two
    bundles were produced by the same compiler.
    """
    inputs = {
        "templates": tree_digest(paths.templates_dir()),
        "spec": tree_digest(_PACKAGE / "spec"),
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
) -> tuple[CachedKernel, bool]:
    key = cache.key(rendered, options)
    if (hit := cache.get(key)) is not None:
        return hit, True
    compiled = compile_kernel(rendered, source_dir, options)
    families = tuple(sorted(sass_families(compiled.cubin)))
    required = rendered.spec.REQUIRED_SASS
    if problems := sass_problems(set(families), required):
        raise CompileError(
            f"{rendered.name}: " + "; ".join(problems) + f" (SASS families: {', '.join(families)})",
            compiled.log, source_dir / f"{rendered.name}.cu",
        )
    kernel = CachedKernel(compiled.cubin, compiled.resources, families, compiled.seconds)
    cache.put(key, kernel)
    return kernel, False


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
    cache: KernelCache, progress: ProgressCallback | None,
) -> list[tuple[CachedKernel, bool]]:
    """(kernel, came from the cache) per rendered kernel, in order; the first failure raises."""
    results: list[tuple[CachedKernel, bool] | None] = [None] * len(rendered)
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="fagen-nvrtc") as pool:
        futures = {
            pool.submit(_build_one, r, staging / "src" / r.spec.arch.value, options[r.spec.arch],
                        cache): i
            for i, r in enumerate(rendered)
        }
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    if future.exception() is not None:
                        raise future.exception()
                    index = futures[future]
                    results[index] = future.result()
                    if progress is not None:
                        kernel, cached = results[index]
                        progress(_kernel_build(rendered[index].spec, kernel, cached),
                                 sum(r is not None for r in results), len(rendered))
        except BaseException:
            # A failure or Ctrl-C (KeyboardInterrupt reaches this thread, inside wait()): drop
            # the queue, so that leaving the pool waits only for the compiles already running
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
            built = _compile_all(rendered, options, writer.staging, jobs, cache, progress)
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
