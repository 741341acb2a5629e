"""A process's memory of ``git status``: a later fit skips git when nothing git reads has changed since.

Every fit records the state of the code it ran (:mod:`lightning_repro.manifest.codestate`): one ``git status``, a
child process of ~3 ms of CPU on a small checkout, which a 2-core machine pays nearly whole in the fit's wall time
(measured: ~6 ms of the ~7 ms a 1-step fit costs beyond plain Lightning). A process that fits again (tests, sweeps,
two Trainers, the benchmarks) reads the same checkout again. So each process remembers, per checkout:

* the paths git reported ignored (``--ignored=matching``: an ignored directory as one path, never entered);
* the stats (modification and change times in ns, size, inode, mode) of every other entry of the worktree,
  directories included, and of the files git reads besides (``HEAD``, the index, the branch's ref,
  ``packed-refs``, the config, ``info/exclude`` and ``info/attributes``, the global config and ignore files),
  taken *before* the git run whose answer is kept;
* that answer (the code section).

A fit whose snapshot of the same checkout equals the remembered one reuses the answer: nothing git reads changed
since before it ran (a changed, added, removed or renamed entry changes a file's or a directory's stats; a tracked
file inside an ignored directory is not pruned, git reports such a directory's files one by one). Otherwise git
runs as always, and the snapshot taken before it is remembered with its answer. The first fit of a process learns
the ignored paths only, so git runs at the first two fits of a checkout.

The answer is not remembered (git runs every time, as without this module) when:

* an entry's modification or change time lies within :data:`~lightning_repro.manifest.datahash.RACY_SECONDS` of the
  snapshot (a file rewritten within its file system's timestamp resolution could keep its stats: git's "racy"
  rule); a fit that writes into the worktree (a ``lightning_logs`` folder not in ``.gitignore``) keeps it fresh;
* the worktree has more than :data:`MAX_ENTRIES` entries outside ignored directories (walking it would cost what
  git costs);
* the checkout has submodules (``.gitmodules``: git reads their repositories too), its ``.git`` is not a
  directory (a linked worktree), a config file names other ignore or attribute files or includes others, or the
  environment points git elsewhere or configures it (``GIT_DIR``, ``GIT_WORK_TREE``, ``GIT_INDEX_FILE``,
  ``GIT_CONFIG*``...);
* the ignored paths git reported changed between the snapshot and the answer.

``GIT_*`` environment variables, ``HOME`` and ``XDG_CONFIG_HOME`` are part of a checkout's key.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_repro.manifest.datahash import RACY_SECONDS

__all__ = ["MAX_ENTRIES", "Snapshot", "forget", "recall", "remember", "snapshot"]

MAX_ENTRIES = 2000
"""Worktree entries outside ignored directories beyond which a checkout is not snapshot (git runs every fit)."""

_GIT_FILES = (
    "HEAD", "index", "packed-refs", "config", "config.worktree", "info/exclude", "info/attributes",
    "info/sparse-checkout", "shallow",
)  # fmt: skip
_CONFIG_WORDS = (b"excludesfile", b"attributesfile", b"include", b"worktree")
_RULES = (".gitignore", ".gitattributes")  # watched even where ignored themselves (a folder's `*`): git reads them

Stat = tuple[int, int, int, int, int] | None
Snapshot = tuple[tuple[str, Stat], ...]
"""Sorted ``(path, stats)`` of what ``git status`` reads in one checkout (None: a file that does not exist)."""


@dataclass
class _Known:
    ignored: frozenset[str]
    snapshot: Snapshot | None  # taken before the git run that gave `section`
    section: dict[str, Any] | None
    off: bool = False  # the checkout does not suit a snapshot (see the module): git runs every fit


class _Unsuited(Exception):
    """The checkout cannot be snapshot for as long as this process runs (too large, submodules...)."""


_MEMORY: dict[tuple[str, ...], _Known] = {}


_GIT_LOCATIONS = (
    "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY", "GIT_NAMESPACE",
)  # fmt: skip


def _git_elsewhere() -> bool:
    """The environment points git at other files than the checkout's own, or configures it (``GIT_CONFIG*``)."""
    return any(name in os.environ for name in _GIT_LOCATIONS) or any(k.startswith("GIT_CONFIG") for k in os.environ)


def _key(root: Path) -> tuple[str, ...]:
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("GIT_") or k in ("HOME", "XDG_CONFIG_HOME"))
    return (str(root), *env)


def _stat(path: str) -> Stat:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode


def _global_files() -> list[str]:
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    return [
        os.path.join(home, ".gitconfig"),
        *(os.path.join(xdg, "git", name) for name in ("config", "ignore", "attributes")),
        "/etc/gitconfig",
    ]


def _branch_ref(git_dir: str) -> str | None:
    try:
        with open(os.path.join(git_dir, "HEAD"), "rb") as f:
            head = f.read(512).strip()
    except OSError:
        return None
    return head[5:].strip().decode("utf-8", "surrogateescape") if head.startswith(b"ref: ") else None


def _configs_are_plain(paths: list[str]) -> bool:
    """No config names ignore or attribute files, another worktree, or includes other configs."""
    for path in paths:
        try:
            with open(path, "rb") as f:
                text = f.read(1 << 20).lower()
        except OSError:
            continue
        if any(word in text for word in _CONFIG_WORDS):
            return False
    return True


def snapshot(root: Path, ignored: frozenset[str]) -> Snapshot | None:
    """The stats of everything ``git status`` reads in the checkout at ``root``, or None when not to be trusted now.

    Args:
        root: The top of the checkout (holding ``.git``).
        ignored: The ignored paths git reported (relative, ``/``-separated, a directory with a trailing ``/``).

    Raises:
        _Unsuited: the checkout does not suit a snapshot (see the module).
    """
    top = str(root)
    git_dir = os.path.join(top, ".git")
    if not os.path.isdir(git_dir) or os.path.lexists(os.path.join(top, ".gitmodules")) or _git_elsewhere():
        raise _Unsuited
    branch = _branch_ref(git_dir)
    configs = [os.path.join(git_dir, "config"), os.path.join(git_dir, "config.worktree"), *_global_files()]
    if not _configs_are_plain(configs):
        raise _Unsuited
    fresh = time.time_ns() - int(RACY_SECONDS * 1e9)
    seen: list[tuple[str, Stat]] = [(f".git/{name}", _stat(os.path.join(git_dir, name))) for name in _GIT_FILES]
    if branch is not None:
        seen.append((f".git/{branch}", _stat(os.path.join(git_dir, branch))))
    seen += [(path, _stat(path)) for path in _global_files()]
    seen.append(("", _stat(top)))
    newest = max((max(stats[0], stats[1]) for _, stats in seen if stats is not None), default=0)
    stack = [""]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(os.path.join(top, folder)) as entries:
                for entry in entries:
                    name = folder + entry.name
                    if name == ".git":
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        name += "/"
                        if name in ignored:
                            continue
                        stack.append(name)
                    elif name in ignored and entry.name not in _RULES:
                        continue
                    st = entry.stat(follow_symlinks=False)
                    seen.append((name, (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode)))
                    newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:  # a folder that went away or cannot be read: git will say
            return None
        if len(seen) > MAX_ENTRIES:
            raise _Unsuited
    if newest >= fresh:
        return None
    return tuple(sorted(seen))


def recall(root: Path) -> tuple[dict[str, Any] | None, Snapshot | None]:
    """What this process knows of the checkout at ``root``.

    Returns:
        ``(code section, None)`` when the remembered answer still holds, else ``(None, snapshot)``: the snapshot
        to hand to :func:`remember` after git ran (None: nothing to remember).
    """
    known = _MEMORY.get(_key(root))
    if known is None or known.off:
        return None, None
    try:
        now = snapshot(root, known.ignored)
    except _Unsuited:
        known.off = True
        return None, None
    if now is not None and now == known.snapshot and known.section is not None:
        return dict(known.section), None
    return None, now


def remember(root: Path, before: Snapshot | None, ignored: frozenset[str] | None, section: Mapping[str, Any]) -> None:
    """Keep git's answer for ``root``.

    Args:
        root: The top of the checkout.
        before: :func:`recall`'s snapshot, taken before git ran.
        ignored: The ignored paths git reported; None: it could not report them (git before 2.16), the checkout
            is not snapshot again in this process.
        section: The code section made of git's answer.
    """
    key = _key(root)
    known = _MEMORY.get(key)
    if ignored is None or (known is not None and known.off):
        _MEMORY[key] = _Known(frozenset(), None, None, off=True)
        return
    same_pruning = known is not None and known.ignored == ignored
    _MEMORY[key] = _Known(ignored, before if same_pruning else None, dict(section) if same_pruning else None)


def forget() -> None:
    """Forget every checkout (git runs at the next fits again)."""
    _MEMORY.clear()
