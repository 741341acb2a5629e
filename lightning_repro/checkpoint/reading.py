"""Reading a checkpoint file: a truncated or damaged one is one clear error (re-exported by ``entry.py``)."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_repro.exceptions import CheckpointReadError, InputError

__all__ = ["METADATA_FILE", "STATE_KEY_PREFIX", "entries_in", "load_for_reading", "read_checkpoint"]

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
    """
    import torch

    where = Path(path)
    file = where / METADATA_FILE if where.is_dir() else where
    if not file.is_file():
        hint = f" (a distributed checkpoint directory holds {METADATA_FILE})" if where.is_dir() else ""
        raise InputError(f"{str(file)!r} does not exist or is not a file{hint}; pass a .ckpt file or directory")
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


def entries_in(checkpoint: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The lightning-repro entries of a loaded checkpoint, ``(state key, entry)`` in the file's order."""
    callbacks = checkpoint.get("callbacks")
    found = callbacks.items() if isinstance(callbacks, dict) else ()
    return [(str(k), v) for k, v in found if str(k).startswith(STATE_KEY_PREFIX) and isinstance(v, dict)]
