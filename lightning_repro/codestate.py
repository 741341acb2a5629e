"""The code a run ran: the git commit, dirty flag and a digest of the uncommitted diff, or the package's files.

The manifest's ``code`` section (:mod:`lightning_repro.manifest`). git runs with ``GIT_OPTIONAL_LOCKS=0`` (a status
must not take the user's index lock) and a timeout of 10 s per call; a directory outside a git checkout, a missing
git or a timeout fall back to a digest of the ``.py`` files of the LightningModule's package.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_repro.datahash import file_digests

__all__ = ["code_manifest", "start_code_manifest"]

_GIT_TIMEOUT = 10.0


def _run_output(name: str) -> bool:
    """An untracked file a Lightning run writes (a checkpoint, a log, our manifest): not part of the code."""
    parts = name.split("/")
    return name.endswith(".ckpt") or "lightning_logs" in parts or parts[-1] == "repro_manifest.json"


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


def _checkout_root(where: Path) -> Path | None:
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

    Runs git twice (``status`` and, on speculation, ``diff HEAD``), both at once, each with a timeout of 10 s; the
    checkout's top is found without git (the nearest directory with a ``.git``). The diff digest covers
    ``git diff HEAD`` and the names and contents of untracked files (read through the digest cache of
    :mod:`lightning_repro.datahash`),
    except what a run writes: ``*.ckpt``, anything under ``lightning_logs/`` and ``repro_manifest.json`` (list
    other outputs in ``.gitignore``). Outside a git checkout (or without git) the section holds a digest of the
    ``.py`` files of ``module``'s top-level package instead (``source`` alone when it is not in a package).

    Args:
        source: A file or directory inside the checkout (the LightningModule's source file).
        module: The dotted name of the module defining the LightningModule (for the fallback).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     code_manifest(d)["git_commit"] is None
        True
    """
    return start_code_manifest(source, module=module)()


def start_code_manifest(source: str | os.PathLike[str], *, module: str | None = None) -> Callable[[], dict[str, Any]]:
    """Start :func:`code_manifest`: ``git status`` runs as a child process while the caller goes on.

    Returns:
        A function that waits for git and returns the code section (call it once).
    """
    path = Path(source).resolve()
    where = path if path.is_dir() else path.parent
    root = _checkout_root(where)
    status = None
    if root is not None:
        with contextlib.suppress(OSError):  # no git: the fallback below
            status = _start_git(root, "status", "--porcelain=v2", "-z", "--branch", "--untracked-files=all")
    return lambda: _finish_code_manifest(path, module, root, status)


def _tracked_patch(root: Path) -> str | None:
    """``git diff HEAD``: the tracked files' changes (None when git fails, e.g. a timeout)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return _finish_git(_start_git(root, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff"))
    return None


def _finish_code_manifest(
    path: Path, module: str | None, root: Path | None, status: subprocess.Popen[bytes] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"git_commit": None, "dirty": None, "diff_sha256": None}
    status_text = None
    if status is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # a timeout
            status_text = _finish_git(status)
    if root is None or status_text is None:  # not a checkout, no git, a timeout
        return {**out, **_package_files(path, module)}
    records = [r for r in status_text.split("\0") if r]
    commit = next((r.split()[2] for r in records if r.startswith("# branch.oid ")), None)
    changed = [r for r in records if not r.startswith("#") and not (r.startswith("? ") and _run_output(r[2:]))]
    untracked = sorted(r[2:] for r in changed if r.startswith("? "))
    out.update(git_commit=None if commit in (None, "(initial)") else commit, dirty=bool(changed))
    if changed:
        h = hashlib.sha256(b"lightning-repro diff v1")
        if out["git_commit"] is not None:
            # a second git process only for a tracked change (~1.3 ms of CPU beside the fit): the diff of a tree
            # with untracked files only is empty
            tracked = any(not r.startswith("? ") for r in changed)
            patch = _tracked_patch(root) if tracked else ""
            h.update(b"\0git diff failed\0" if patch is None else patch.encode("utf-8", "surrogateescape"))
        files = [name for name in untracked if (root / name).is_file()]
        for name, digest in zip(files, file_digests([root / name for name in files]), strict=True):
            h.update(f"\0untracked\0{name}\0{digest}".encode())
        out["diff_sha256"] = h.hexdigest()
    return out
