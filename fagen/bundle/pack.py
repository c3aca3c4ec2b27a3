"""One-file bundles: a deterministic tar of a bundle directory, and its unpacking for loading.

Standard library only (the runtime unpacks packed bundles on machines without pydantic/NVRTC).

Layout of a packed bundle: every file of the bundle under one top-level directory named after
the bundle, plus ``<bundle>/SHA256SUMS`` (``sha256sum -c`` format) over all the other files, so
sources and headers are covered as well as the cubins the manifest lists. Entries are sorted,
with zeroed mtimes, uids and gids and fixed modes: packing the same bundle twice gives the same
bytes. Compression follows the output suffix: ``.tar`` (none), ``.tar.gz``/``.tgz`` (gzip),
``.tar.zst``/``.tzst`` (zstd, needs Python >= 3.14 for ``compression.zstd``).

Loading a packed file extracts it once into a cache directory keyed by the file's sha256
(``$FAGEN_BUNDLE_CACHE``, else ``$XDG_CACHE_HOME/fagen/bundles``, else ``~/.cache/fagen/bundles``)
after checking every member against SHA256SUMS; later loads of the same file reuse it, after
checking the extracted files against the same SHA256SUMS again. Extracting
rather than reading members in memory keeps one code path for directories and packed files, and
gives C++ consumers and ``fagen list`` the same directory to look at.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .format import MANIFEST_NAME, BundleError, read_manifest

CHECKSUMS_NAME = "SHA256SUMS"
_GZIP_SUFFIXES = (".tar.gz", ".tgz")
_ZSTD_SUFFIXES = (".tar.zst", ".tzst")
_FILE_MODE = 0o644


def _zstd():
    try:
        from compression import zstd  # Python >= 3.14
    except ImportError:
        raise BundleError(
            "zstd-compressed bundles need Python >= 3.14 (compression.zstd); use .tar.gz or .tar"
        ) from None
    return zstd


def compress(data: bytes, name: str) -> bytes:
    if name.endswith(_GZIP_SUFFIXES):
        buffer = io.BytesIO()
        # mtime=0 and no file name in the gzip header: the output depends on the content only.
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as stream:
            stream.write(data)
        return buffer.getvalue()
    if name.endswith(_ZSTD_SUFFIXES):
        return _zstd().compress(data)
    if name.endswith(".tar"):
        return data
    raise BundleError(
        f"{name}: unknown packed-bundle suffix; use .tar, .tar.gz (.tgz) or .tar.zst (.tzst)"
    )


def decompress(data: bytes, where: str) -> bytes:
    """The tar bytes of a packed file, recognising the compression by its magic number."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:4] == b"\x28\xb5\x2f\xfd":
        return _zstd().decompress(data)
    if len(data) > 262 and data[257:262] == b"ustar":
        return data
    raise BundleError(f"{where}: not a packed fagen bundle (neither tar, gzip nor zstd)")


def bundle_files(bundle_dir: Path) -> list[str]:
    """Every regular file of the bundle, as sorted POSIX paths relative to `bundle_dir`."""
    names = []
    for path in bundle_dir.rglob("*"):
        if path.is_symlink():
            raise BundleError(f"{path}: bundles hold regular files only, not links")
        if path.is_file():
            names.append(path.relative_to(bundle_dir).as_posix())
    return sorted(names)


def checksums_text(files: dict[str, bytes]) -> str:
    return "".join(f"{hashlib.sha256(files[name]).hexdigest()}  {name}\n" for name in sorted(files))


def pack_bundle(bundle_dir: str | Path, out_file: str | Path) -> Path:
    """Write the bundle at `bundle_dir` as one file (format: module docstring), atomically."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    top = manifest.bundle
    files = {
        name: (bundle_dir / name).read_bytes()
        for name in bundle_files(bundle_dir)
        if name != CHECKSUMS_NAME
    }
    files[CHECKSUMS_NAME] = checksums_text(files).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(files[name])
            info.mode = _FILE_MODE
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(files[name]))
    out_file = Path(out_file)
    data = compress(buffer.getvalue(), out_file.name)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(f".{out_file.name}.partial-{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, out_file)
    return out_file


@dataclass(frozen=True)
class PackedBundle:
    """The members of a packed bundle, read into memory and checked against SHA256SUMS."""

    top: str
    files: dict[str, bytes]  # path relative to the bundle root -> bytes; without SHA256SUMS


def _member_name(member: tarfile.TarInfo, where: str) -> tuple[str, str]:
    path = PurePosixPath(member.name)
    if not member.isfile() or path.is_absolute() or ".." in path.parts or len(path.parts) < 2:
        raise BundleError(
            f"{where}: unexpected member {member.name!r} (a packed bundle holds regular files "
            "under one top-level directory)"
        )
    return path.parts[0], PurePosixPath(*path.parts[1:]).as_posix()


def _parse_checksums(text: str, where: str) -> dict[str, str]:
    digests = {}
    for line in text.splitlines():
        digest, separator, name = line.partition("  ")
        if not separator or len(digest) != 64:
            raise BundleError(f"{where}: malformed {CHECKSUMS_NAME} line {line!r}")
        digests[name] = digest
    return digests


def read_packed(path: str | Path, raw: bytes | None = None) -> PackedBundle:
    """Read and check a packed bundle: one top-level directory, SHA256SUMS matching every member.
    `raw`: the file's bytes, when the caller has read them already.

    Raises BundleError naming the first member that is missing, extra or modified.
    """
    where = str(path)
    if raw is None:
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise BundleError(f"{where}: no such packed bundle") from None
        except (IsADirectoryError, NotADirectoryError):
            raise BundleError(f"{where}: not a packed bundle file") from None
    try:
        tar_bytes = decompress(raw, where)
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            tops, files = set(), {}
            for member in tar.getmembers():
                top, name = _member_name(member, where)
                tops.add(top)
                files[name] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BundleError(f"{where}: unreadable packed bundle ({exc})") from None
    if len(tops) != 1:
        raise BundleError(f"{where}: expected one top-level directory, found {sorted(tops)}")
    if CHECKSUMS_NAME not in files:
        raise BundleError(f"{where}: no {CHECKSUMS_NAME}; was it made by `fagen pack`?")
    expected = _parse_checksums(files.pop(CHECKSUMS_NAME).decode(errors="replace"), where)
    _check_against_checksums(files, expected, where, "packing")
    if MANIFEST_NAME not in files:
        raise BundleError(f"{where}: no {MANIFEST_NAME} in the packed bundle")
    return PackedBundle(tops.pop(), files)


def _check_against_checksums(files: dict[str, bytes], expected: dict[str, str], where: str,
                             since: str) -> None:
    if missing := sorted(set(expected) - set(files)):
        raise BundleError(f"{where}: {CHECKSUMS_NAME} lists missing members: {', '.join(missing)}")
    if extra := sorted(set(files) - set(expected)):
        raise BundleError(f"{where}: members not in {CHECKSUMS_NAME}: {', '.join(extra)}")
    for name, data in sorted(files.items()):
        digest = hashlib.sha256(data).hexdigest()
        if digest != expected[name]:
            raise BundleError(
                f"{where}: member {name} does not match {CHECKSUMS_NAME} (expected sha256 "
                f"{expected[name][:16]}…, got {digest[:16]}…); the file was modified after "
                f"{since} — refusing to load it"
            )


def cache_dir() -> Path:
    if env := os.environ.get("FAGEN_BUNDLE_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fagen" / "bundles"


def _read_tree(root: Path) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name in bundle_files(root)}


def unpack_cached(path: str | Path) -> Path:
    """The bundle directory of the packed file at `path`, extracted (after checking) into the
    cache on first use. The file is read once: the cache entry is named by the sha256 of exactly
    the bytes that are extracted, so a file replaced meanwhile can only make a new entry. The
    entry keeps the packed SHA256SUMS beside its bundle/ and every later use re-checks the
    extracted files against it (a cache entry edited or damaged since is refused)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{path}: no such packed bundle") from None
    entry = cache_dir() / hashlib.sha256(raw).hexdigest()
    if (entry / CHECKSUMS_NAME).is_file():
        expected = _parse_checksums((entry / CHECKSUMS_NAME).read_text(errors="replace"), str(entry))
        _check_against_checksums(_read_tree(entry / "bundle"), expected, str(entry / "bundle"),
                                 "it was unpacked from " + str(path))
        return entry / "bundle"
    packed = read_packed(path, raw)
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        for name, data in packed.files.items():
            target = staging / "bundle" / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        (staging / CHECKSUMS_NAME).write_text(checksums_text(packed.files))
        staging.chmod(0o755)
        try:
            os.replace(staging, entry)
        except OSError:
            # Another process extracted the same bytes first; its copy is identical.
            if not (entry / CHECKSUMS_NAME).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return entry / "bundle"
