"""Write a bundle directory atomically: a staging directory beside the output, swapped in at
the end (one atomic exchange of the two directories where the OS offers it:
docs/bundle-format.md, "Rebuilding in place"), so readers see the old bundle or the new one,
never a mix and never none.

What goes into the bundle is the build's business (fagen/build.py); this module knows the
layout on disk: sources and cubins where the manifest says, manifest.json, and the headers
(params.h, fagen.hpp, index.h, contract.h). Writes of one output are serialised by a lock in
the machine's fagen cache, not beside the output; leftovers of a build that was killed are
removed by the next one. A failed build keeps its staging directory as `<out>.failed/` and
leaves the old bundle untouched.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from .. import paths
from .contract_header import CONTRACT_HEADER, render_contract_header
from .cindex import INDEX_HEADER, PARAMS_HEADER, render_index_header
from .format import MANIFEST_NAME, Manifest

CPP_LOADER_HEADER = "include/fagen/fagen.hpp"

_RENAME_EXCHANGE = 2  # linux/fs.h


@functools.lru_cache(maxsize=1)
def _renameat2():
    """libc's renameat2 (Linux, glibc >= 2.28), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    return function


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directories in one atomic step; False where the OS or filesystem cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    at_cwd = -100  # AT_FDCWD
    return renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), _RENAME_EXCHANGE) == 0


def _swap_in(staging: Path, out_dir: Path) -> None:
    """Put `staging` at `out_dir`. With an atomic exchange no reader ever finds `out_dir`
    missing; elsewhere two renames leave it missing for a moment."""
    if out_dir.exists() and _exchange(staging, out_dir):
        shutil.rmtree(staging, ignore_errors=True)  # now the previous bundle
        return
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / "bundle")
    os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# Lock files are never deleted (unlinking one that another process waits on would let two
# writers in), so the paths share a fixed number of them: writes of two bundles that land in
# the same slot take turns, which costs nothing but a rare wait.
LOCK_SLOTS = 16


def _lock_path(out_dir: Path) -> Path:
    """Where writes of `out_dir` take turns: in the machine's fagen cache, so that nothing but
    the bundle appears beside it."""
    slot = int(hashlib.sha256(os.fsencode(out_dir)).hexdigest(), 16) % LOCK_SLOTS
    return paths.cache_root() / "locks" / f"bundle-{slot:02d}.lock"


def _remove_leftovers(out_dir: Path) -> None:
    """Staging and old directories of writes of `out_dir` that were killed (the caller holds
    the lock, so none of them is in use)."""
    for pattern in (f".{out_dir.name}.building-*", f".{out_dir.name}.old-*"):
        for leftover in out_dir.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not (out_dir / MANIFEST_NAME).is_file():
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise FileExistsError(
                f"{out_dir} exists and is not a fagen bundle (no {MANIFEST_NAME}); refusing to "
                "replace it: choose another -o"
            )


class BundleWriter:
    """``with BundleWriter(out) as writer:`` write files into ``writer.staging``, then
    ``writer.commit(manifest)``; leaving the block without a commit discards the staging
    directory, ``writer.keep_failed()`` keeps it as `<out>.failed/` instead."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir).resolve()
        self.staging: Path | None = None
        self._lock: FileLock | None = None

    @property
    def failed_dir(self) -> Path:
        return self.out_dir.with_name(self.out_dir.name + ".failed")

    def __enter__(self) -> "BundleWriter":
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        _check_replaceable(self.out_dir)
        lock = _lock_path(self.out_dir)
        lock.parent.mkdir(parents=True, exist_ok=True)
        self._lock = FileLock(str(lock))
        self._lock.acquire()
        try:
            _remove_leftovers(self.out_dir)
            self.staging = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.building-",
                                                 dir=self.out_dir.parent))
            self.staging.chmod(0o755)  # mkdtemp makes it private; a bundle is read by others
        except BaseException:
            self._lock.release()
            raise
        return self

    def write(self, relative: str, data: bytes | str) -> Path:
        target = self.staging / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            target.write_text(data)
        else:
            target.write_bytes(data)
        return target

    def keep_failed(self) -> Path:
        """Keep what was written as `<out>.failed/` (for the sources a compile error names)."""
        shutil.rmtree(self.failed_dir, ignore_errors=True)
        os.replace(self.staging, self.failed_dir)
        kept, self.staging = self.staging, None
        return kept

    def commit(self, manifest: Manifest) -> None:
        """Write the manifest and the headers, and swap the bundle in."""
        self.write(MANIFEST_NAME, manifest.to_json())
        for header in (PARAMS_HEADER, CPP_LOADER_HEADER):
            self.write(header, (paths.templates_dir() / header).read_bytes())
        self.write(INDEX_HEADER, render_index_header(manifest))
        self.write(CONTRACT_HEADER, render_contract_header())
        _swap_in(self.staging, self.out_dir)
        self.staging = None
        shutil.rmtree(self.failed_dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        try:
            if self.staging is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._lock.release()
