"""Build a bundle: render, compile (cached, in parallel), check SASS, write atomically.

The build happens in a temp dir beside the output and is swapped in with renames, so readers see
the old bundle or the new one, never a mix. A failed build leaves its sources in `<out>.failed/`
(the error names the file) and the old bundle untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from .. import paths
from .._version import __version__
from ..codegen import RenderedKernel, launch_info, render
from ..compiler import (
    CachedKernel, CompileError, KernelCache, NvrtcOptions, PtxasResources, cache_root,
    compile_kernel, compiler_versions, options_for, sass_families, sass_problems,
    toolchain_versions, tree_digest,
)
from ..spec import ARCHS, Arch, Expansion, KernelSpec, algorithm_for
from .cindex import INDEX_HEADER, PARAMS_HEADER, render_index_header
from .format import MANIFEST_NAME, KernelEntry, Launch, Manifest, Resources, sha256_bytes

CPP_LOADER_HEADER = "include/fagen/fagen.hpp"


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
    """sha256 over the templates, the codegen sources, fagen's version, toolchain and flags.

    Equal fingerprints mean equal inputs apart from the spec file: a consumer can tell whether two
    bundles were produced by the same compiler.
    """
    inputs = {
        "templates": tree_digest(paths.templates_dir()),
        "codegen": tree_digest(Path(__file__).resolve().parent.parent / "codegen"),
        "fagen": __version__,
        "toolchain": toolchain,
        "flags": {arch.value: list(opts.flags) for arch, opts in sorted(options.items())},
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _skipped_records(expansion: Expansion) -> tuple[dict, ...]:
    return tuple(
        {"entry": index, "fields": fields, "why": why} for index, fields, why in expansion.skipped
    )


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir / MANIFEST_NAME).is_file():
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise FileExistsError(
                f"{out_dir} exists and is not a fagen bundle (no {MANIFEST_NAME}); refusing to "
                "replace it: choose another -o"
            )


def _build_one(
    rendered: RenderedKernel, source_dir: Path, options: NvrtcOptions, cache: KernelCache
) -> tuple[CachedKernel, bool]:
    key = cache.key(rendered, options)
    if (hit := cache.get(key)) is not None:
        return hit, True
    compiled = compile_kernel(rendered, source_dir, options)
    families = tuple(sorted(sass_families(compiled.cubin)))
    algorithm = algorithm_for(rendered.spec.fa_version, rendered.spec.direction)
    required = algorithm.required_sass if algorithm else ()
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
    launch = launch_info(spec)
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
        launch=Launch(**launch.as_dict()),
        resources=Resources(registers=r.registers, spill_bytes=r.spill_bytes,
                            stack_bytes=r.stack_bytes, static_smem=r.static_smem),
        sass=kernel.sass,
        max_seqlen_k=spec.max_seqlen_k,
    )


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
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()
                index = futures[future]
                results[index] = future.result()
                if progress is not None:
                    kernel, cached = results[index]
                    progress(_kernel_build(rendered[index].spec, kernel, cached),
                             sum(r is not None for r in results), len(rendered))
    return results


def _kernel_build(spec: KernelSpec, kernel: CachedKernel, cached: bool) -> KernelBuild:
    return KernelBuild(spec.name, spec.arch.value, kernel.resources, len(kernel.cubin),
                       kernel.seconds, cached)


def _swap_in(staging: Path, out_dir: Path) -> None:
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / "bundle")
    os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _keep_failed(staging: Path, out_dir: Path, exc: CompileError) -> CompileError:
    failed = out_dir.with_name(out_dir.name + ".failed")
    shutil.rmtree(failed, ignore_errors=True)
    os.replace(staging, failed)
    if exc.source_path is None:
        return exc
    try:
        return exc.with_source_path(failed / Path(exc.source_path).relative_to(staging))
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
    SASS families, local memory), RenderError for a template problem, FileExistsError when
    `out_dir` holds something that is not a bundle.
    """
    start = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _check_replaceable(out_dir)
    toolchain = toolchain_versions()
    cache = KernelCache(cache_dir or cache_root(), compiler_versions(), paths.include_dir())

    with FileLock(str(out_dir.parent / f".{out_dir.name}.lock")):
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; a bundle is meant to be read by others
        try:
            rendered = [render(spec) for spec in expansion.specs]
            for r in rendered:
                source = staging / "src" / r.spec.arch.value / f"{r.name}.cu"
                source.parent.mkdir(parents=True, exist_ok=True)
                source.write_text(r.source)
            options = {arch: options_for(arch) for arch in {r.spec.arch for r in rendered}}
            try:
                built = _compile_all(rendered, options, staging, jobs, cache, progress)
            except CompileError as exc:
                raise _keep_failed(staging, out_dir, exc) from None
            kernels = [kernel for kernel, _ in built]
            manifest = _write_bundle(expansion, rendered, kernels, options, staging, toolchain)
            _swap_in(staging, out_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(out_dir.with_name(out_dir.name + ".failed"), ignore_errors=True)

    return BuildReport(
        bundle_dir=out_dir,
        manifest=manifest,
        kernels=tuple(
            _kernel_build(r.spec, kernel, cached) for r, (kernel, cached) in zip(rendered, built)
        ),
        skipped=manifest.skipped,
        seconds=time.perf_counter() - start,
    )


def _write_bundle(
    expansion: Expansion, rendered: list[RenderedKernel], kernels: list[CachedKernel],
    options: dict[Arch, NvrtcOptions], staging: Path, toolchain: dict[str, str],
) -> Manifest:
    entries = []
    for r, kernel in zip(rendered, kernels):
        entry = _entry(r.spec, kernel)
        cubin = staging / entry.cubin
        cubin.parent.mkdir(parents=True, exist_ok=True)
        cubin.write_bytes(kernel.cubin)
        entries.append(entry)
    manifest = Manifest(
        bundle=expansion.bundle,
        fingerprint=fingerprint(options, toolchain),
        toolchain=dict(toolchain),
        kernels=tuple(entries),
        skipped=_skipped_records(expansion),
    )
    (staging / MANIFEST_NAME).write_text(manifest.to_json())
    for header in (PARAMS_HEADER, CPP_LOADER_HEADER):
        target = staging / header
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(paths.templates_dir() / header, target)
    (staging / INDEX_HEADER).write_text(render_index_header(manifest))
    return manifest
