"""Open a bundle, pick the cubin for a device, load it lazily and launch it.

Selection uses only what the manifest says about each entry (``compute_capability``,
``arch_specific``), not fagen.model, so that this path needs neither pydantic nor Jinja.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections import defaultdict
from pathlib import Path

from .. import contract, paths
from ..bundle.format import BundleError, KernelEntry, read_bundle
from ..bundle.pack import unpack_cached
from . import driver


def launch_grid(entry: KernelEntry, seqlen_q: int, heads_q: int, batch: int, device: int,
                seqlen_k: int = 0, heads_kv: int = 0, num_splits: int = 1) -> tuple[int, int, int]:
    """The grid for a launch of `entry` on device `device` (contract.Launch.grid_dims)."""
    sms = driver.multiprocessor_count(device) if entry.launch.grid == "persistent" else 0
    return entry.launch.grid_dims(seqlen_q, heads_q, batch, sms, seqlen_k, heads_kv, num_splits)


class KernelNotFound(LookupError):
    """No kernel in the bundle has the requested key and runs on the device."""


def runs_on(entry: KernelEntry, compute_capability: tuple[int, int]) -> bool:
    """Whether the entry's cubin runs on a device of `compute_capability`.

    SASS is compatible only within a major version (an sm_80 cubin does not run on sm_90), and
    arch-specific ("a") cubins only on exactly their compute capability.
    """
    major, minor = entry.compute_capability
    if entry.arch_specific:
        return (major, minor) == tuple(compute_capability)
    return compute_capability[0] == major and compute_capability[1] >= minor


def _preference(entry: KernelEntry) -> tuple:
    # Newer algorithm first, then the cubin built for the closest (highest) compute capability
    # the device runs, then the arch-specific build of that capability.
    return (entry.fa_version, tuple(entry.compute_capability), entry.arch_specific)


def _seqlen_fit(entry: KernelEntry, seqlen_k: int | None) -> tuple:
    """Larger is better: a bound that covers seqlen_k (the tightest first), then an unbounded
    kernel, then a bound below it (the loosest first: every kernel is correct at any length).
    seqlen_k None (not known) counts as longer than any bound."""
    bound = entry.max_seqlen_k
    if bound is None:
        return (1, 0)
    return (2, -bound) if seqlen_k is not None and bound >= seqlen_k else (0, bound)


def preferred_family(
    entries: tuple[KernelEntry, ...] | list[KernelEntry],
    key: str,
    compute_capability: tuple[int, int],
    bundle_dir: str | Path = "<bundle>",
    fa_version: int | None = None,
) -> tuple[KernelEntry, ...]:
    """The entries with exactly `key` (and `fa_version`, when given) that run on
    `compute_capability` and rank first by algorithm and target (_preference); they differ only
    in their seqlen_k bounds."""
    candidates = [e for e in entries if e.key == key and runs_on(e, compute_capability)
                  and fa_version in (None, e.fa_version)]
    if not candidates:
        message = _not_found_message(entries, key, compute_capability, bundle_dir)
        if fa_version is not None:
            message = f"(asked for fa_version={fa_version}) " + message
        raise KernelNotFound(message)
    best = max(_preference(e) for e in candidates)
    return tuple(e for e in candidates if _preference(e) == best)


def for_length(family: tuple[KernelEntry, ...], seqlen_k: int | None) -> KernelEntry:
    """The member of a preferred_family whose seqlen_k bound fits the call best (_seqlen_fit)."""
    if len(family) == 1:
        return family[0]
    return max(family, key=lambda e: _seqlen_fit(e, seqlen_k))


def select(
    entries: tuple[KernelEntry, ...] | list[KernelEntry],
    key: str,
    compute_capability: tuple[int, int],
    seqlen_k: int | None = None,
    bundle_dir: str | Path = "<bundle>",
    fa_version: int | None = None,
) -> KernelEntry:
    """The kernel a call with `seqlen_k` keys runs: the preferred family for the device (of
    `fa_version`, when given), then the seqlen_k bound that fits the call best."""
    return for_length(preferred_family(entries, key, compute_capability, bundle_dir, fa_version),
                      seqlen_k)


def _parse_key(key: str) -> dict | None:
    """``fwd/bf16/hd128/causal+softcap`` -> its fields (with the variant's spelling); None when
    the key has another shape."""
    parsed = contract.KernelKey.parse(key)
    if parsed is None:
        return None
    return {**dataclasses.asdict(parsed), "variant": contract.variant_name(parsed.mask, parsed.mods)}


def _compact_keys(keys: set[str]) -> str:
    """Group keys that differ only in head dims: ``fwd/bf16/hd{64,128,192v128}/causal``."""
    head_dims: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    others = []
    for key in keys:
        fields = _parse_key(key)
        if fields is None:
            others.append(key)
            continue
        layout = "" if fields["layout"] == contract.LAYOUTS[0] else f"/{fields['layout']}"
        group = (fields["direction"], fields["dtype"], fields["variant"] + layout)
        head_dims[group].append((fields["head_dim"], fields["head_dim_v"] or 0))
    grouped = []
    for (direction, dtype, mask), dims in sorted(head_dims.items()):
        dims_text = ",".join(contract.head_dims_name(d, v or None) for d, v in sorted(dims))
        grouped.append(f"{direction}/{dtype}/hd{{{dims_text}}}/{mask}" if len(dims) > 1
                       else f"{direction}/{dtype}/hd{dims_text}/{mask}")
    return ", ".join(grouped + sorted(others))


def _arch_for(compute_capability: tuple[int, int]) -> str:
    # The plain (non-"a") target: FA2 runs on any sm80+ arch and its cubin also covers later
    # minor revisions.
    return f"sm{compute_capability[0]}{compute_capability[1]}"


def _not_found_message(entries, key: str, compute_capability: tuple[int, int], bundle_dir) -> str:
    cc_text = f"{compute_capability[0]}.{compute_capability[1]}"
    lines = [f"no kernel for {key!r} on a compute capability {cc_text} device in bundle {bundle_dir}."]
    by_arch: dict[str, set[str]] = defaultdict(set)
    for entry in entries:
        by_arch[f"{entry.arch} (fa{entry.fa_version})"].add(entry.key)
    if by_arch:
        lines.append("The bundle holds:")
        lines.extend(f"  {arch}: {_compact_keys(keys)}" for arch, keys in sorted(by_arch.items()))
    else:
        lines.append("The bundle holds no kernels.")
    elsewhere = sorted({e.arch for e in entries if e.key == key})
    if elsewhere:
        lines.append(
            f"{key!r} is built only for {', '.join(elsewhere)}, which does not run on {cc_text} "
            "(a cubin runs only on its own major version; 'a' targets only on exactly their "
            "compute capability)."
        )
    fields = _parse_key(key)
    if fields is not None:
        snippet = (
            f"{{fa_version: 2, arch: {_arch_for(compute_capability)}, direction: {fields['direction']}, "
            f"dtype: {fields['dtype']}, head_dim: {fields['head_dim']}, "
            + (f"head_dim_v: {fields['head_dim_v']}, " if fields["head_dim_v"] else "")
            + f"mask: {fields['mask']}" + (f", score: {'+'.join(fields['mods'])}" if fields["mods"] else "")
            + ("" if fields["layout"] == contract.LAYOUTS[0] else f", layout: {fields['layout']}")
            + "}"
        )
        lines.append(
            f"To add it, put this entry under `kernels:` in your spec: {snippet} "
            f"and run `fagen build SPEC -o {bundle_dir}`."
        )
    return "\n".join(lines)


class LoadedKernel:
    """One kernel of a bundle, loaded into the driver; prepared per device on first launch."""

    def __init__(self, entry: KernelEntry, image: bytes):
        self.entry = entry
        # The image stays referenced for the library's lifetime: with lazy loading the driver
        # may read it after cuLibraryLoadData returns.
        self._image = image
        self._library = driver.load_library(image)
        self._kernel = None
        self._companions: dict[str, object] = {}
        self._ready_devices: set[int] = set()
        self._lock = threading.Lock()

    def _prepare(self, device: int) -> None:
        with self._lock:
            if device in self._ready_devices:
                return
            if self._kernel is None:
                self._kernel = driver.get_kernel(self._library, self.entry.name)
            driver.set_max_dynamic_smem(self._kernel, self.entry.launch.dynamic_smem, device)
            self._ready_devices.add(device)

    def launch(
        self,
        params: ctypes.Structure,
        grid: tuple[int, int, int],
        stream: int,
        device: int | None = None,
        extra_params: tuple[ctypes.Array | ctypes.Structure, ...] = (),
    ) -> None:
        """Launch on `stream` (a CUstream handle as an int, e.g. torch's ``cuda_stream``, of the
        device's primary context) of device `device` (default: the current context's device,
        else 0). `params` is the FagenFwdParams; TMA kernels take their tensor maps as
        `extra_params`. The caller's current context is current again afterwards."""
        if device is None:
            device = driver.current_device() or 0
        with driver.primary_context(device):
            self.enqueue(params, grid, stream, device, extra_params)

    def enqueue(
        self,
        params: ctypes.Structure,
        grid: tuple[int, int, int],
        stream: int,
        device: int,
        extra_params: tuple[ctypes.Array | ctypes.Structure, ...] = (),
    ) -> None:
        """launch() for a caller that made device `device`'s primary context current."""
        if device not in self._ready_devices:
            self._prepare(device)
        launch = self.entry.launch
        driver.launch(
            self._kernel, grid, (launch.threads, 1, 1), launch.dynamic_smem, stream, (params, *extra_params)
        )

    def enqueue_companion(self, suffix: str, params: ctypes.Structure, grid: tuple[int, int, int],
                          threads: int, stream: int, extra_params: tuple = ()) -> None:
        """Launch the cubin's kernel `<name><suffix>` (a backward's preprocess or dQ kernel,
        fagen/contract.py) with `params` and `extra_params`; it takes no dynamic shared memory;
        the caller made the device's primary context current."""
        kernel = self._companions.get(suffix)
        if kernel is None:
            with self._lock:
                kernel = self._companions.setdefault(
                    suffix, driver.get_kernel(self._library, self.entry.name + suffix))
        driver.launch(kernel, grid, (threads, 1, 1), 0, stream, (params, *extra_params))

    def enqueue_backward(self, params: ctypes.Structure, grid: tuple[int, int, int], rows: tuple[int, int, int],
                         stream: int, device: int, extra_params: tuple = ()) -> None:
        """A backward's three kernels in order on `stream` (fagen/contract.py, "Backward
        kernels"): the preprocess over `rows`, this main kernel over `grid` with `extra_params`,
        the dQ conversion over `rows`, all with the FagenBwdParams `params`; the caller made
        the device's primary context current."""
        self.enqueue_companion(contract.BWD_PREPROCESS_SUFFIX, params, rows, contract.BWD_ROW_THREADS, stream)
        self.enqueue(params, grid, stream, device, extra_params)
        self.enqueue_companion(contract.BWD_CONVERT_SUFFIX, params, rows, contract.BWD_ROW_THREADS, stream)


class Bundle:
    """A bundle directory: its manifest, kernel selection, and lazily loaded kernels.

    Opening reads and verifies every cubin against the manifest (a few milliseconds for the
    default bundle), so a damaged bundle is refused here rather than at some later first
    launch, and the process never reads the directory again: rebuilding the bundle in place
    cannot change what an open Bundle runs (docs/bundle-format.md, "Rebuilding in place").
    """

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        self.manifest, self._images = read_bundle(self.path)
        self._loaded: dict[str, LoadedKernel] = {}
        self._families: dict[tuple, tuple[KernelEntry, ...]] = {}
        self._lock = threading.Lock()

    @property
    def kernels(self) -> list[KernelEntry]:
        return list(self.manifest.kernels)

    def select(self, key: str, compute_capability: tuple[int, int],
               seqlen_k: int | None = None, fa_version: int | None = None) -> KernelEntry:
        """The best entry with exactly `key` (of `fa_version`, when given) that runs on
        `compute_capability`, for calls with `seqlen_k` keys (see select); raises
        KernelNotFound (saying what the bundle holds and how to add the kernel) otherwise."""
        request = (key, tuple(compute_capability), fa_version)
        family = self._families.get(request)
        if family is None:
            family = self._families[request] = preferred_family(
                self.manifest.kernels, key, request[1], self.path, fa_version)
        return for_length(family, seqlen_k)

    def kernel(self, entry: KernelEntry) -> LoadedKernel:
        """The loaded kernel for `entry` (one of this bundle's), handed to the driver on first
        use from the cubin verified when the bundle was opened."""
        loaded = self._loaded.get(entry.name)
        if loaded is not None:
            return loaded
        with self._lock:
            if entry.name not in self._loaded:
                image = self._images.get(entry.name)
                if image is None or entry not in self.manifest.kernels:
                    raise BundleError(f"{entry.name}: not a kernel of bundle {self.path}")
                self._loaded[entry.name] = LoadedKernel(entry, image)
            return self._loaded[entry.name]

    def __repr__(self) -> str:
        return f"Bundle({str(self.path)!r}, {len(self.manifest.kernels)} kernels)"


def load(path: str | Path | None = None) -> Bundle:
    """Open the bundle at `path` (default: fagen.paths.default_bundle_dir()): a bundle directory
    or a file made by `fagen pack`, which is checked and extracted once into a cache directory
    keyed by its sha256 (fagen.bundle.pack).

    Raises BundleError for a missing bundle, a newer schema, another kernel ABI version or a
    packed file whose members do not match their checksums.
    """
    path = paths.default_bundle_dir() if path is None else Path(path)
    return Bundle(unpack_cached(path) if path.is_file() else path)


__all__ = ["Bundle", "BundleError", "KernelNotFound", "LoadedKernel", "load", "runs_on", "select"]
