"""Content digests of data files and directories, with a cache so that large data is not re-read every run.

A file's SHA-256 is cached under the key ``(absolute path, size, mtime_ns)`` in one JSON file,
``$LIGHTNING_REPRO_CACHE/file-digests.json`` (default ``~/.cache/lightning-repro/``). A file whose size or
modification time changed is read again. The cache is written atomically (a temporary file, then
``os.replace``); a missing, unreadable or damaged cache is ignored (every file is read), never an error.

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

__all__ = ["CACHE_ENV", "RACY_SECONDS", "PathsDigest", "cache_file", "file_digests", "hash_file", "hash_paths"]

CACHE_ENV = "LIGHTNING_REPRO_CACHE"
"""The environment variable naming the cache directory (default ``~/.cache/lightning-repro``)."""

RACY_SECONDS = 2.0
"""A cache entry of a file modified less than this long before it was hashed is not trusted (read again)."""

_CHUNK = 1 << 20


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


def cache_file() -> Path:
    """The JSON file holding the cached digests (see the module docstring)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "lightning-repro")
    return Path(root) / "file-digests.json"


def _load_cache(path: Path) -> dict[str, list[object]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # missing or damaged: read every file
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("files"), dict):
        return {}
    return {k: v for k, v in data["files"].items() if isinstance(v, list) and len(v) == 4}


def _save_cache(path: Path, files: dict[str, list[object]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".file-digests-", suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump({"version": 1, "files": files}, out)
        os.replace(tmp, path)  # atomic: a reader sees the old cache or the new one, never half of one
    except OSError:
        pass  # a read-only home or a full disk: the digests are still right, only not remembered


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_file(path: str | os.PathLike[str], cache: dict[str, list[object]] | None = None) -> tuple[str, bool]:
    """The SHA-256 of one file's content, and whether it came from the cache.

    Args:
        path: The file.
        cache: The cache as :func:`hash_paths` holds it (``{path: [size, mtime_ns, checked_ns, sha256]}``),
            updated in place; ``None`` reads the file.

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
        cache[key] = [stat.st_size, stat.st_mtime_ns, checked, digest]
    return digest, False


def file_digests(files: Sequence[str | os.PathLike[str]]) -> list[str]:
    """The SHA-256 of each file's content, through the cache (one read and at most one write of it)."""
    cache_path = cache_file()
    cache = _load_cache(cache_path)
    digests, hits = [], 0
    for file in files:
        digest, cached = hash_file(file, cache)
        digests.append(digest)
        hits += cached
    if hits < len(digests):
        _save_cache(cache_path, cache)
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
    cache_path = cache_file()
    cache = _load_cache(cache_path) if use_cache else None
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
    if cache is not None and hits < files:
        _save_cache(cache_path, cache)
    return PathsDigest(sha256=h.hexdigest(), files=files, bytes_read=read, cache_hits=hits)
