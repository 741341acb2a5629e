"""Content digests of data files and directories, with a cache so that large data is not re-read every run.

A file's SHA-256 is cached under the key ``(absolute path, size, mtime_ns)`` in
``$LIGHTNING_REPRO_CACHE/file-digests/`` (default ``~/.cache/lightning-repro/``): 256 small JSON files, a file's
entry in the one named by the first byte of the SHA-256 of its path, so a run that digests a few files (the
changed files of a checkout) reads a few small files, however many files other runs cached. A file whose size or
modification time changed is read again. Each bucket keeps its :data:`BUCKET_ENTRIES` most recently hashed
entries; it is written atomically (a temporary file, then ``os.replace``), merged with what another process wrote
meanwhile; a missing, unreadable or damaged bucket is ignored (its files are read), never an error.

An entry is trusted only when the file's modification time lies at least :data:`RACY_SECONDS` before the moment
it was hashed: a file rewritten within the timestamp resolution of its file system (coarse on many) could keep its
size and mtime while its content changed, so such a "racy" entry is read again (git's rule for its index).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUCKET_ENTRIES",
    "CACHE_ENV",
    "RACY_SECONDS",
    "DigestCache",
    "PathsDigest",
    "cache_dir",
    "file_digests",
    "hash_file",
    "hash_paths",
]

CACHE_ENV = "LIGHTNING_REPRO_CACHE"
"""The environment variable naming the cache directory (default ``~/.cache/lightning-repro``)."""

RACY_SECONDS = 2.0
"""A cache entry of a file modified less than this long before it was hashed is not trusted (read again)."""

BUCKET_ENTRIES = 4096
"""The most entries one of the 256 cache buckets keeps (about a million files in all); the oldest go first."""

_CHUNK = 1 << 20
_LEGACY = "file-digests.json"  # before 0.x: one file holding every entry, read whole by every run


@dataclass
class PathsDigest:
    """The digest of some files' contents, and how it was obtained.

    Attributes:
        sha256: SHA-256 over every file's name (relative to the path given) and content digest, in sorted order.
        files: How many files were hashed.
        bytes_read: How many bytes were read (the sizes of the files not taken from the cache).
        cache_hits: How many files' digests came from the cache.
    """

    sha256: str
    files: int
    bytes_read: int
    cache_hits: int


def cache_dir() -> Path:
    """The directory of the cache's buckets (see the module docstring)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "lightning-repro")
    return Path(root) / "file-digests"


def _bucket_of(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:2]


def _read_bucket(path: Path) -> dict[str, list[object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged: its files are read
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("files"), dict):
        return {}
    return {k: v for k, v in data["files"].items() if isinstance(v, list) and len(v) == 4}


def _checked(item: tuple[str, list[object]]) -> int:
    checked = item[1][2]
    return checked if isinstance(checked, int) else 0


class DigestCache:
    """The digest cache of one run: buckets read when first needed, written back (merged) by :meth:`save`.

    ``get``/``set`` take the key :func:`hash_file` uses (the resolved path); an entry is
    ``[size, mtime_ns, checked_ns, sha256]``.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or cache_dir()
        self._buckets: dict[str, dict[str, list[object]]] = {}
        self._new: dict[str, dict[str, list[object]]] = {}

    def _bucket(self, name: str) -> dict[str, list[object]]:
        bucket = self._buckets.get(name)
        if bucket is None:
            bucket = self._buckets[name] = _read_bucket(self.directory / f"{name}.json")
        return bucket

    def get(self, key: str) -> list[object] | None:
        """The entry of ``key``, or None."""
        return self._bucket(_bucket_of(key)).get(key)

    def set(self, key: str, entry: list[object]) -> None:
        """Remember ``entry`` for ``key`` (written by :meth:`save`)."""
        name = _bucket_of(key)
        self._bucket(name)[key] = entry
        self._new.setdefault(name, {})[key] = entry

    def save(self) -> None:
        """Write the buckets that got new entries: each re-read, merged, trimmed, replaced atomically."""
        if not self._new:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for name, entries in self._new.items():
                path = self.directory / f"{name}.json"
                merged = {**_read_bucket(path), **entries}  # another process may have written it meanwhile
                if len(merged) > BUCKET_ENTRIES:  # the most recently hashed stay
                    merged = dict(sorted(merged.items(), key=_checked, reverse=True)[:BUCKET_ENTRIES])
                fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{name}-", suffix=".tmp")
                with os.fdopen(fd, "w") as out:
                    json.dump({"version": 1, "files": merged}, out)
                os.replace(tmp, path)  # atomic: a reader sees the old bucket or the new one, never half of one
            legacy = self.directory.parent / _LEGACY
            if legacy.exists():
                legacy.unlink()  # the old single-file cache, replaced by the buckets
        except OSError:
            pass  # a read-only home or a full disk: the digests are still right, only not remembered
        self._new = {}


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_file(path: str | os.PathLike[str], cache: DigestCache | None = None) -> tuple[str, bool]:
    """The SHA-256 of one file's content, and whether it came from the cache.

    Args:
        path: The file.
        cache: The run's :class:`DigestCache` (a new entry is remembered there, written by its ``save``);
            ``None`` reads the file.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (Path(d) / "x.bin").write_bytes(b"abc")
        ...     hash_file(Path(d) / "x.bin")
        ('ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad', False)
    """
    resolved = Path(path).resolve()
    stat = resolved.stat()
    key = str(resolved)
    if cache is not None:
        hit = cache.get(key)
        if (
            hit is not None
            and hit[0] == stat.st_size
            and hit[1] == stat.st_mtime_ns
            and isinstance(hit[2], int)
            and stat.st_mtime_ns <= hit[2] - int(RACY_SECONDS * 1e9)
            and isinstance(hit[3], str)
        ):
            return hit[3], True
    checked = time.time_ns()
    digest = _sha256_of(resolved)
    if cache is not None:
        cache.set(key, [stat.st_size, stat.st_mtime_ns, checked, digest])
    return digest, False


def file_digests(files: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The SHA-256 of each file's content, through the cache (the buckets of these files, read once, written once)."""
    cache = DigestCache()
    digests = []
    for file in files:
        digests.append(hash_file(file, cache)[0])
    cache.save()
    return digests


def _files_of(path: Path) -> list[tuple[str, Path]]:
    if path.is_dir():
        found = [p for p in path.rglob("*") if p.is_file()]
        return sorted((p.relative_to(path).as_posix(), p) for p in found)
    return [(path.name, path)]


def hash_paths(paths: Sequence[str | os.PathLike[str]], *, use_cache: bool = True) -> PathsDigest:
    """One digest over the contents of files and directories (every file below them, recursively).

    The digest depends on the files' names relative to each path given (a file's own name) and on their contents,
    not on where the paths lie, so moving the data elsewhere keeps it.

    Args:
        paths: Files or directories.
        use_cache: Take the digest of a file whose size and modification time did not change from the cache.

    Raises:
        ValueError: a path does not exist.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (Path(d) / "a.txt").write_text("1")
        ...     hash_paths([d], use_cache=False).files
        1
    """
    cache = DigestCache() if use_cache else None
    h = hashlib.sha256(b"lightning-repro paths v1")
    files = read = hits = 0
    for position, given in enumerate(paths):
        path = Path(given)
        if not path.exists():
            raise ValueError(f"`data_paths` holds {str(given)!r}, which does not exist; pass existing files or folders")
        for name, file in _files_of(path):
            digest, cached = hash_file(file, cache)
            h.update(f"{position}\0{name}\0{digest}\n".encode())
            files += 1
            hits += cached
            read += 0 if cached else file.stat().st_size
    if cache is not None:
        cache.save()
    return PathsDigest(sha256=h.hexdigest(), files=files, bytes_read=read, cache_hits=hits)
