"""The code a run ran: the git commit, dirty flag and a digest of the uncommitted changes, or the package's files.

The manifest's ``code`` section (:mod:`lightning_repro.manifest.collect`). One ``git status`` runs (with
``GIT_OPTIONAL_LOCKS=0``: a status must not take the user's index lock; a timeout of 10 s), unless this process
read the same checkout before and nothing git reads changed since (:mod:`lightning_repro.manifest.gitcache`); the
digest of a dirty tree (``diff_sha256``) covers every path git reports changed or untracked, by name, kind of
change and current content (read here, through the digest cache, instead of a second git process for
``git diff HEAD``: ~1.3 ms of CPU beside the starting fit). A directory outside a git checkout, a missing git or
a timeout fall back to a digest of the ``.py`` files of the LightningModule's package.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_repro.manifest import gitcache as _gitcache
from lightning_repro.manifest.datahash import file_digests

__all__ = ["checkout_root", "code_manifest", "start_code_manifest"]

_GIT_TIMEOUT = 10.0


def _run_output(name: str) -> bool:
    """An untracked file a Lightning run writes (a checkpoint, a log, our manifest or step trace): not code.

    Logs of the loggers' and launchers' default folders count too: Weights & Biases ``wandb/``, MLflow ``mlruns/``,
    Hydra's ``outputs/`` and ``multirun/`` at the checkout's top: each run adds files there, which would make every
    resume look like a code change.
    """
    parts = name.split("/")
    return (
        name.endswith(".ckpt")
        or "lightning_logs" in parts
        or "wandb" in parts[:-1]
        or "mlruns" in parts[:-1]
        or (len(parts) > 1 and parts[0] in ("outputs", "multirun"))
        or parts[-1] == "repro_manifest.json"
        or re.fullmatch(r"trace-rank\d+\.jsonl", parts[-1]) is not None
    )


def _start_git(cwd: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}  # status must not take the user's index lock
    return subprocess.Popen(
        ["git", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
    )


def _finish_git(process: subprocess.Popen[bytes]) -> str:
    try:
        out, _ = process.communicate(timeout=_GIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, process.args)
    return out.decode("utf-8", "surrogateescape")


def checkout_root(where: Path) -> Path | None:
    """The top of the git checkout holding ``where`` (the nearest directory with a ``.git``), without running git."""
    for directory in (where, *where.parents):
        if (directory / ".git").exists():
            return directory
    return None


def _package_files(source: Path, module: str | None) -> dict[str, Any]:
    """Digests of the ``.py`` files of the package ``module`` belongs to (or of ``source`` alone)."""
    top = sys.modules.get(module.split(".")[0]) if module else None
    roots = [Path(p) for p in getattr(top, "__path__", [])] if top is not None else []
    files = (
        sorted((p.relative_to(root).as_posix(), p) for root in roots for p in root.rglob("*.py"))
        if roots
        else ([(source.name, source)] if source.is_file() else [])
    )
    h = hashlib.sha256(b"lightning-repro files v1")
    for (name, _), digest in zip(files, file_digests([path for _, path in files]), strict=True):
        h.update(f"{name}\0{digest}\n".encode())
    return {"files_sha256": h.hexdigest() if files else None, "files": len(files)}


def code_manifest(source: str | os.PathLike[str], *, module: str | None = None) -> dict[str, Any]:
    """The code section: git commit, dirty flag and diff digest of the checkout holding ``source``.

    Runs ``git status`` once, with a timeout of 10 s; the checkout's top is found without git (the nearest
    directory with a ``.git``). The diff digest covers every path git reports changed, renamed, deleted or
    untracked: the kind of change, the name, the worktree mode and the current content (read through the digest
    cache of :mod:`lightning_repro.manifest.datahash`; staging a change does not change the digest), except what a run
    writes: ``*.ckpt``, anything under ``lightning_logs/`` and ``repro_manifest.json`` (list
    other outputs in ``.gitignore``). Outside a git checkout (or without git) the section holds a digest of the
    ``.py`` files of ``module``'s top-level package instead (``source`` alone when it is not in a package).

    Args:
        source: A file or directory inside the checkout (the LightningModule's source file).
        module: The dotted name of the module defining the LightningModule (for the fallback).

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     code_manifest(d)["git_commit"] is None
        True
    """
    return start_code_manifest(source, module=module)()


def start_code_manifest(source: str | os.PathLike[str], *, module: str | None = None) -> Callable[[], dict[str, Any]]:
    """Start :func:`code_manifest`: ``git status`` runs as a child process while the caller goes on.

    A checkout this process read before, unchanged since (:mod:`lightning_repro.manifest.gitcache`), is not read
    again: the same section is returned.

    Returns:
        A function that waits for git and returns the code section (call it once).
    """
    path = Path(source).resolve()
    where = path if path.is_dir() else path.parent
    root = checkout_root(where)
    status, before = None, None
    if root is not None:
        known, before = _gitcache.recall(root)
        if known is not None:
            return lambda: known
        with contextlib.suppress(OSError):  # no git: the fallback below
            status = _start_git(root, *_STATUS)
    return lambda: _finish_code_manifest(path, module, root, status, before)


_STATUS = ("status", "--porcelain=v2", "-z", "--branch", "--untracked-files=all", "--ignored=matching")
"""``--ignored=matching`` (git 2.16): the ignored paths, an ignored directory as one path, for the snapshot."""
_USAGE = 129  # git's exit status for an option it does not know
_OLD_GIT: Any = object()  # marks an answer of a git without --ignored=matching (nothing to snapshot with)


def _changes(records: list[str]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """The commit and the changed paths of ``git status --porcelain=v2 -z`` records: ``(kind, path, mode)``.

    ``kind`` is ``changed`` (ordinary, ``1``), ``renamed`` (``2``: its origin follows as ``gone``), ``unmerged``
    (``u``) or ``untracked`` (``?``, without run outputs); ``mode`` is the worktree's (``000000``: deleted).
    """
    commit, changes = None, []
    fields = {"1": 8, "2": 9, "u": 10}
    pending_origin = False
    for record in records:
        if pending_origin:  # a rename's origin path: its own NUL-terminated field
            changes.append(("gone", record, "000000"))
            pending_origin = False
        elif record.startswith("# branch.oid "):
            commit = record.split()[2]
        elif record.startswith("? "):
            if not _run_output(record[2:]):
                changes.append(("untracked", record[2:], ""))
        elif record[:2] in ("1 ", "2 ", "u "):
            parts = record.split(" ", fields[record[0]])
            mode = parts[6] if record[0] == "u" else parts[5]
            changes.append(({"1": "changed", "2": "renamed", "u": "unmerged"}[record[0]], parts[-1], mode))
            pending_origin = record[0] == "2"
    return commit, changes


UNTRACKED_BY_SIZE = 16 << 20
"""An untracked file of this many bytes or more enters the dirty digest by its size, not its content (see below)."""


def _worktree_digest(root: Path, changes: list[tuple[str, str, str]]) -> str:
    """One SHA-256 over each change's kind, path, worktree mode and current content (symlink: its target).

    An untracked file of :data:`UNTRACKED_BY_SIZE` bytes or more (a dataset, weights, an archive downloaded into
    the checkout: data, not code) contributes its size instead of its content, which the first fit would otherwise
    read whole (gigabytes, for a dataset folder not in ``.gitignore``).
    """
    h = hashlib.sha256(b"lightning-repro worktree v2")
    files, sizes = [], {}
    for kind, path, _ in changes:
        where = root / path
        if where.is_file() and not where.is_symlink():
            size = where.stat().st_size
            if kind == "untracked" and size >= UNTRACKED_BY_SIZE:
                sizes[where] = f"size:{size}"
            else:
                files.append(where)
    contents = {**dict(zip(files, file_digests(files), strict=True)), **sizes}
    for kind, path, mode in changes:
        where = root / path
        if where.is_symlink():
            content = "link:" + os.readlink(where)
        elif where in contents:
            content = contents[where]
        else:
            content = "directory" if where.is_dir() else "missing"  # a submodule; a deleted file
        h.update(f"\0{kind}\0{path}\0{mode}\0{content}".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _finish_code_manifest(
    path: Path,
    module: str | None,
    root: Path | None,
    status: subprocess.Popen[bytes] | None,
    before: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {"git_commit": None, "dirty": None, "diff_sha256": None}
    status_text = None
    if status is not None and root is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # a timeout
            try:
                status_text = _finish_git(status)
            except subprocess.CalledProcessError as error:
                if error.returncode != _USAGE:
                    raise
                before = _OLD_GIT  # a git before 2.16, without --ignored=matching: asked again without it
                status_text = _finish_git(_start_git(root, *_STATUS[:-1]))
    if root is None or status_text is None:  # not a checkout, no git, a timeout
        return {**out, **_package_files(path, module)}
    records = [r for r in status_text.split("\0") if r]
    commit, changes = _changes(records)
    out.update(git_commit=None if commit in (None, "(initial)") else commit, dirty=bool(changes))
    if changes:
        out["diff_sha256"] = _worktree_digest(root, sorted(changes, key=lambda change: change[1]))
    ignored = frozenset(r[2:] for r in records if r.startswith("! ")) if before is not _OLD_GIT else None
    _gitcache.remember(root, before if before is not _OLD_GIT else None, ignored, out)
    return out
