"""Content-addressed cache of compiled kernels, shared by every bundle built on this machine.

Layout: `<cache_root>/kernels/<key[:2]>/<key>.cubin` and `<key>.json` (ptxas resources, SASS
families, compile time, the cubin's sha256). The key covers everything that decides the cubin:
the rendered source, the fagen headers it includes (transitively; the source alone is not
enough, and hashing only those keeps an edit to an unrelated header from recompiling everything),
the code flags, the NVRTC build and the fagen version. Two spec files that share variants
(default.yaml and ampere.yaml) therefore compile them once. Entries are written atomically and
checked against their sha256 when read; a damaged entry is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .._version import __version__
from ..codegen import RenderedKernel
from .options import NvrtcOptions
from .resources import PtxasResources


@dataclass(frozen=True)
class CachedKernel:
    cubin: bytes
    resources: PtxasResources
    sass: tuple[str, ...]
    seconds: float  # how long the compile took when it ran


def tree_digest(root: Path) -> str:
    """sha256 over every file under `root` (relative path and bytes), in a stable order; `root`
    must exist (a moved directory would otherwise digest as empty, the same every time)."""
    if not root.is_dir():
        raise FileNotFoundError(f"tree_digest: {root} is not a directory")
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.MULTILINE)


class IncludeDigest:
    """sha256 over the headers under `include_root` that a source reaches through #include.

    Every #include is followed whatever #if surrounds it (a superset is safe); names that do not
    resolve under the including file's directory or `include_root` are NVRTC's bundled headers,
    which the NVRTC version in the key covers. File contents are read once per instance.
    """

    def __init__(self, include_root: Path):
        self.include_root = Path(include_root)
        self._texts: dict[Path, str] = {}

    def _text(self, path: Path) -> str:
        if path not in self._texts:
            self._texts[path] = path.read_text()
        return self._texts[path]

    def _resolve(self, name: str, including_dir: Path | None) -> Path | None:
        for base in (including_dir, self.include_root):
            if base is not None and (base / name).is_file():
                return (base / name).resolve()
        return None

    def __call__(self, source: str) -> str:
        seen: set[Path] = set()
        pending = [(source, None)]
        while pending:
            text, directory = pending.pop()
            for name in _INCLUDE.findall(text):
                path = self._resolve(name, directory)
                if path is not None and path not in seen:
                    seen.add(path)
                    pending.append((self._text(path), path.parent))
        digest = hashlib.sha256()
        for path in sorted(seen):
            digest.update(os.path.relpath(path, self.include_root).encode() + b"\0")
            digest.update(self._text(path).encode() + b"\0")
        return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class KernelCache:
    def __init__(self, root: Path, toolchain: dict[str, str], include_root: Path):
        self.root = Path(root) / "kernels"
        self._salt = json.dumps({"toolchain": toolchain, "fagen": __version__}, sort_keys=True)
        self._include_digest = IncludeDigest(include_root)

    def key(self, rendered: RenderedKernel, options: NvrtcOptions) -> str:
        digest = hashlib.sha256()
        headers = self._include_digest(rendered.source)
        for part in (self._salt, "\0".join(options.flags), headers, rendered.source):
            digest.update(part.encode() + b"\0")
        return digest.hexdigest()

    def _paths(self, key: str) -> tuple[Path, Path]:
        base = self.root / key[:2] / key
        return base.with_suffix(".cubin"), base.with_suffix(".json")

    def get(self, key: str) -> CachedKernel | None:
        cubin_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
            if hashlib.sha256(cubin).hexdigest() != meta["sha256"]:
                return None
            return CachedKernel(
                cubin=cubin,
                resources=PtxasResources(**meta["resources"]),
                sass=tuple(meta["sass"]),
                seconds=float(meta["seconds"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, kernel: CachedKernel) -> None:
        cubin_path, meta_path = self._paths(key)
        meta = {
            "sha256": hashlib.sha256(kernel.cubin).hexdigest(),
            "resources": asdict(kernel.resources),
            "sass": list(kernel.sass),
            "seconds": kernel.seconds,
        }
        # The cubin first: a reader that finds the json also finds the cubin it describes.
        _write_atomic(cubin_path, kernel.cubin)
        _write_atomic(meta_path, json.dumps(meta, sort_keys=True).encode())
