"""Reading a checkpoint file: a truncated or damaged one is one clear error (re-exported by ``entry.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_repro.exceptions import CheckpointReadError

__all__ = ["read_checkpoint"]


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
