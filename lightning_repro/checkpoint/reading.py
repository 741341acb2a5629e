"""Reading a checkpoint file: a truncated or damaged one is one clear error (re-exported by ``entry.py``)."""

from __future__ import annotations

import filecmp
import os
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_repro._warn import say
from lightning_repro.checkpoint.seal import DIGEST_KEY
from lightning_repro.exceptions import CheckpointReadError, InputError

__all__ = [
    "METADATA_FILE",
    "STATE_KEY_PREFIX",
    "distributed_parts_problem",
    "entries_in",
    "load_for_reading",
    "read_checkpoint",
    "same_but_named",
    "same_save_said",
    "saved_after",
]

STATE_KEY_PREFIX = "DeterminismCallback"
"""What our entries' keys among a checkpoint's ``"callbacks"`` start with (the callback's ``state_key``)."""
METADATA_FILE = "meta.pt"
"""A distributed checkpoint directory's non-tensor state (Lightning's sharded layout), our entry included."""


def read_checkpoint(load_checkpoint: Callable[..., Any], path: Any, *args: Any, **kwargs: Any) -> Any:
    """Read a checkpoint file with ``load_checkpoint`` (the strategy's); an unreadable file is one clear error.

    Raises:
        CheckpointReadError: the file is truncated or damaged (chained from the reader's error); a missing file
            keeps Lightning's own ``FileNotFoundError``, which names the path.
    """
    try:
        return load_checkpoint(path, *args, **kwargs)
    except FileNotFoundError:
        raise
    except Exception as error:
        if isinstance(path, (str, os.PathLike)) and "://" not in str(path) and not os.path.exists(path):
            raise  # no such path (a sharded strategy says so with a ValueError): nothing is damaged
        raise CheckpointReadError(
            f"cannot read the checkpoint file {str(path)!r}: {type(error).__name__}: {error}."
            " A truncated or damaged file (an interrupted write or copy) cannot be resumed: pass another"
            " checkpoint as `ckpt_path`, for example an earlier one."
        ) from error


def load_for_reading(path: str | Path) -> dict[str, Any]:
    """A checkpoint file, or a distributed checkpoint directory's :data:`METADATA_FILE`, loaded on the CPU for a look.

    For the command line (``env --compare``, ``inspect``): ``weights_only=True``, nothing applied.

    Raises:
        InputError: no such file, not a file ``torch.save`` wrote, unreadable, or not a checkpoint's dict.
        CheckpointReadError: a file ``torch.save`` began to write, cut short (:func:`cut_short`): damaged.
    """
    import torch

    where = Path(path)
    if where.suffix == ".distcp" or where.name == ".metadata":
        raise InputError(
            f"{str(where)!r} is one file of a distributed checkpoint: pass its directory, {str(where.parent)!r}"
        )
    file = where / METADATA_FILE if where.is_dir() else where
    if not file.is_file():
        hint = f" (a distributed checkpoint directory holds {METADATA_FILE})" if where.is_dir() else ""
        raise InputError(f"{str(file)!r} does not exist or is not a file{hint}; pass a .ckpt file or directory")
    if cut_short(file):
        raise CheckpointReadError(
            f"{str(file)!r} is damaged: it begins as a file torch.save wrote but its end is missing (truncated: an"
            " interrupted write or copy)"
        )
    if not zipfile.is_zipfile(file):  # what torch.save writes
        raise InputError(f"{str(file)!r} is not a checkpoint (not a file torch.save wrote)")
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # damaged, or holding what weights_only refuses
        first = (str(error).strip().splitlines() or [""])[0]  # torch's messages run over several lines
        raise InputError(f"cannot read the checkpoint {str(file)!r}: {type(error).__name__}: {first}") from None
    if not isinstance(checkpoint, dict):
        raise InputError(f"{str(file)!r} holds a {type(checkpoint).__name__}, not a checkpoint")
    return checkpoint


def distributed_parts_problem(directory: Path) -> str | None:
    """What is missing from a distributed checkpoint directory's tensor files; ``None`` when every part is there.

    Reads only the index (``.metadata``) and the files' sizes: each tensor it lists must lie inside its file.
    """
    index = directory / ".metadata"
    if not index.is_file():
        return "its .metadata (the index of its tensor files) is missing"
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except Exception as error:
        first = (str(error).strip().splitlines() or [""])[0]
        return f"its .metadata cannot be read ({type(error).__name__}: {first})"
    needed: dict[str, int] = {}
    for info in storage.values():
        name, end = str(info.relative_path), int(info.offset) + int(info.length)
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            return f"its tensor file {name} is missing"
        if (size := file.stat().st_size) < end:
            return f"its tensor file {name} is cut short ({size} bytes, its tensors reach byte {end})"
    return None


def cut_short(file: Path) -> bool:
    """``file`` begins as a zip archive (what ``torch.save`` writes) but lacks the directory at its end: truncated."""
    try:
        with open(file, "rb") as handle:
            head = handle.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" and not zipfile.is_zipfile(file)


def entries_in(checkpoint: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The lightning-repro entries of a loaded checkpoint, ``(state key, entry)`` in the file's order."""
    callbacks = checkpoint.get("callbacks")
    found = callbacks.items() if isinstance(callbacks, dict) else ()
    return [(str(k), v) for k, v in found if str(k).startswith(STATE_KEY_PREFIX) and isinstance(v, dict)]


def _written(path: str) -> float | None:
    """When the checkpoint ``path`` was written (a distributed checkpoint directory: its metadata file)."""
    try:
        return os.path.getmtime(os.path.join(path, METADATA_FILE) if os.path.isdir(path) else path)
    except OSError:
        return None


def saved_after(resumed: Any) -> Callable[[str, str, tuple[str, int], int], bool | None] | None:
    """Whether a checkpoint was saved after ``resumed`` by a given checkpoint callback at a given step.

    ``(path, name, (state key, index), step)``: ``path`` is written no earlier than ``resumed``, holds ``step``, and
    its own entry's save guards say that the callback (its state key, its rank among that key's) wrote it at that
    step as ``name`` (relative to its ``dirpath``). ``None`` when ``resumed`` is no file or directory on disk.

    The predicate says ``None`` (cannot tell) of a file written no earlier than ``resumed`` at ``step`` that holds
    no callback states at all: a ``save_weights_only`` file, which no entry of ours can name (Lightning writes no
    callback state, and calls no callback's ``on_save_checkpoint``, into it); the caller compares it after its save.
    """
    since = _written(str(resumed)) if resumed else None
    if since is None:
        return None

    def saved(path: str, name: str, writer: tuple[str, int], step: int) -> bool | None:
        written = _written(path)
        if written is None or written < since:
            return False
        try:
            import torch

            file = os.path.join(path, METADATA_FILE) if os.path.isdir(path) else path
            checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # not a checkpoint we can read: keep Lightning's versioned name
            return False
        if not isinstance(checkpoint, dict) or checkpoint.get("global_step") != step:
            return False
        if "callbacks" not in checkpoint and "state_dict" in checkpoint:  # weights only: compared after the save
            return None
        for _, entry in entries_in(checkpoint):
            guards = entry.get("save_guards")
            for guard in guards if isinstance(guards, list) else []:
                if isinstance(guard, dict) and (guard.get("state_key"), guard.get("index")) == writer:
                    return guard.get("step") == step and guard.get("file") == name
        return False

    return saved


def same_but_named(path: str, other: str) -> bool:
    """Whether checkpoint file ``path`` holds what ``other`` holds but for its own file name.

    Both are loaded (``weights_only``, memory-mapped) and compared value by value: tensors by dtype, shape and bytes,
    floats by their bits, strings with ``path``'s file name read as ``other``'s (``ModelCheckpoint``'s
    ``best_model_path`` and ``best_k_models``, our save guards name the file being written), our entries' seals left
    out (they hash those names). Two distributed checkpoint directories: the same files, the metadata file compared
    so, every other file (the shards, ``torch.distributed.checkpoint``'s own metadata) byte for byte. False for a
    file that cannot be read.
    """
    names = (os.path.basename(path), os.path.basename(other))
    if os.path.isdir(path) and os.path.isdir(other):
        return _same_directories(path, other, names)
    if not (os.path.isfile(path) and os.path.isfile(other)):
        return False
    return _same_files(path, other, names)


def _same_files(path: str, other: str, names: tuple[str, str]) -> bool:
    try:
        import torch

        values = [torch.load(p, map_location="cpu", weights_only=True, mmap=True) for p in (path, other)]
    except Exception:  # not a checkpoint we can read: not the same
        return False
    return _same(values[0], values[1], names)


def _same_directories(path: str, other: str, names: tuple[str, str]) -> bool:
    """Two distributed checkpoints hold the same files, each the same (see :func:`same_but_named`)."""
    try:
        files = sorted(os.listdir(path))
        if files != sorted(os.listdir(other)) or METADATA_FILE not in files:
            return False
        for name in files:
            a, b = os.path.join(path, name), os.path.join(other, name)
            if not (os.path.isfile(a) and os.path.isfile(b)):
                return False
            if name == METADATA_FILE:
                same = _same_files(a, b, names)
            elif name == _DCP_METADATA:
                same = _same_dcp_metadata(path, other)
            else:
                same = filecmp.cmp(a, b, shallow=False)
            if not same:
                return False
    except OSError:
        return False
    return True


_DCP_METADATA = ".metadata"
"""``torch.distributed.checkpoint``'s metadata file in a distributed checkpoint directory."""


def _same_dcp_metadata(path: str, other: str) -> bool:
    """Two directories' ``.metadata`` describe the same tensors in the same shard files.

    Its ``storage_meta`` differs in every save (the directory's path, a save id and a load id): left out.
    """
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        a, b = (FileSystemReader(p).read_metadata() for p in (path, other))
    except Exception:  # not a metadata file torch reads: not the same
        return False
    fields = ("state_dict_metadata", "storage_data", "planner_data")
    return all(getattr(a, field, None) == getattr(b, field, None) for field in fields)


def same_save_said(path: str, other: str) -> bool:
    """:func:`same_but_named`; when true, said on rank 0 (the resume then keeps ``other`` and removes ``path``)."""
    if not same_but_named(path, other):
        return False
    say(
        f"{os.path.basename(path)} holds what {other} holds (written at that step by the run resumed, every value"
        " bitwise): that file is kept, the copy removed, as the uninterrupted run names it"
    )
    return True


def _same(a: Any, b: Any, names: tuple[str, str]) -> bool:
    import torch

    if isinstance(a, str) and isinstance(b, str):
        return a.replace(*names) == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        keys = {(k.replace(*names) if isinstance(k, str) else k): k for k in a if k != DIGEST_KEY}
        if set(keys) != {k for k in b if k != DIGEST_KEY}:
            return False
        return all(_same(a[key], b[mapped], names) for mapped, key in keys.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, names) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        x, y = (t.detach().contiguous().reshape(-1) for t in (a, b))
        return x.numel() == 0 or torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)
