"""Capture and restore the process streams, as tensors and plain values only.

A captured state loads with ``torch.load(..., weights_only=True)``: python's Mersenne Twister
state becomes an int64 tensor, numpy's a uint32 key in an int64 tensor plus plain ints and a
float, torch's a uint8 tensor per device. Restoring validates every part before it changes
anything, so a damaged state is never restored half-way.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from lightning_repro.exceptions import CorruptStateError, NotExactWarning
from lightning_repro.seeding import seed_process_streams

__all__ = [
    "StreamFork",
    "capture_process_streams",
    "check_restored",
    "digest_process_streams",
    "fork_process_streams",
    "restore_process_streams",
    "validate_process_streams",
]

_PY_STATE_LEN = 625  # 624 words of MT19937 and the position
_NP_KEY_LEN = 624


def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]


def capture_process_streams() -> dict[str, Any]:
    """Return the states of python ``random``, numpy's global generator, torch CPU and CUDA.

    CUDA states are included for every device once CUDA is initialised (an uninitialised
    CUDA has drawn nothing yet, and capturing would initialise it).

    Returns:
        A dict of tensors and plain values that ``torch.load(weights_only=True)`` accepts.

    Examples:
        >>> import torch
        >>> state = capture_process_streams()
        >>> a = torch.rand(3)
        >>> restore_process_streams(state)
        >>> torch.equal(a, torch.rand(3))
        True
    """
    version, words, gauss_next = random.getstate()
    np_name, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    return {
        "python": {
            "version": int(version),
            "words": torch.from_numpy(np.array(words, dtype=np.int64)),  # twice as fast as torch.tensor(words)
            "gauss_next": gauss_next,
        },
        "numpy": {
            "name": str(np_name),
            "key": torch.from_numpy(np.asarray(np_key, dtype=np.int64).copy()),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": [state.clone() for state in torch.cuda.get_rng_state_all()] if _cuda_active() else [],
    }


def _fail(part: str, why: str) -> CorruptStateError:
    return CorruptStateError(f"the saved RNG state is damaged: {part} {why}; the checkpoint cannot be restored exactly")


def _is_tensor(value: object, dtype: torch.dtype, length: int | None = None) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == dtype
        and value.dim() == 1
        and (length is None or value.numel() == length)
    )


def validate_process_streams(state: object) -> None:
    """Check that ``state`` is a complete capture from :func:`capture_process_streams`.

    Raises:
        CorruptStateError: naming the first damaged part.
    """
    if not isinstance(state, dict):
        raise _fail("the stream state", f"is a {type(state).__name__}, not a dict")
    for part in ("python", "numpy", "torch", "cuda"):
        if part not in state:
            raise _fail(f"the {part!r} stream", "is missing")
    py = state["python"]
    if not isinstance(py, dict) or not _is_tensor(py.get("words"), torch.int64, _PY_STATE_LEN):
        raise _fail("the 'python' stream", f"is not {_PY_STATE_LEN} int64 words")
    if not isinstance(py.get("version"), int) or not (
        py.get("gauss_next") is None or isinstance(py["gauss_next"], float)
    ):
        raise _fail("the 'python' stream", "has a bad version or gauss_next")
    words = py["words"]
    if bool((words < 0).any()) or bool((words > 0xFFFFFFFF).any()):
        raise _fail("the 'python' stream", "has words outside 32 bits")
    npst = state["numpy"]
    if not isinstance(npst, dict) or not _is_tensor(npst.get("key"), torch.int64, _NP_KEY_LEN):
        raise _fail("the 'numpy' stream", f"is not {_NP_KEY_LEN} key words")
    if npst.get("name") != "MT19937" or not isinstance(npst.get("pos"), int) or not 0 <= npst["pos"] <= _NP_KEY_LEN:
        raise _fail("the 'numpy' stream", "has a bad generator name or position")
    if not isinstance(npst.get("has_gauss"), int) or not isinstance(npst.get("cached_gaussian"), float):
        raise _fail("the 'numpy' stream", "has a bad cached gaussian")
    if not _is_tensor(state["torch"], torch.uint8):
        raise _fail("the 'torch' stream", "is not a uint8 tensor")
    if state["torch"].numel() != torch.get_rng_state().numel():
        raise _fail("the 'torch' stream", f"has {state['torch'].numel()} bytes, not {torch.get_rng_state().numel()}")
    cuda = state["cuda"]
    if not isinstance(cuda, (list, tuple)) or not all(_is_tensor(s, torch.uint8) for s in cuda):
        raise _fail("the 'cuda' streams", "are not a list of uint8 tensors")


def restore_process_streams(state: dict[str, Any]) -> None:
    """Restore a state captured by :func:`capture_process_streams`, all streams or none.

    CUDA states are restored when CUDA is available; saved CUDA states without CUDA, or a
    different device count, give a :class:`~lightning_repro.NotExactWarning`.

    Raises:
        CorruptStateError: the state is damaged; nothing was changed.
    """
    validate_process_streams(state)
    py, npst = state["python"], state["numpy"]
    np_key = npst["key"].numpy().astype(np.uint32)
    cuda_states = list(state["cuda"])
    # everything is validated and converted: now apply, none of these can fail half-way
    random.setstate((py["version"], tuple(int(w) for w in py["words"].tolist()), py["gauss_next"]))
    np.random.set_state(("MT19937", np_key, npst["pos"], npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch"].clone())
    if cuda_states:
        if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda_states):
            from lightning_repro._warn import warn

            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            warn(
                f"The checkpoint holds RNG states of {len(cuda_states)} CUDA device(s) but this process sees {have}:"
                " CUDA random draws will not continue exactly.",
                NotExactWarning,
            )
            for device, cuda_state in enumerate(cuda_states[:have]):
                torch.cuda.set_rng_state(cuda_state, device)
        else:
            torch.cuda.set_rng_state_all(cuda_states)


def digest_process_streams(state: dict[str, Any]) -> str:
    """SHA-256 of the raw bytes of a captured state (a fingerprint for the restore check)."""
    h = hashlib.sha256()
    py, npst = state["python"], state["numpy"]
    h.update(b"python")
    h.update(str(py["version"]).encode())
    h.update(py["words"].numpy().tobytes())
    h.update(repr(py["gauss_next"]).encode())
    h.update(b"numpy")
    h.update(npst["key"].numpy().tobytes())
    h.update(repr((npst["pos"], npst["has_gauss"], npst["cached_gaussian"])).encode())
    h.update(b"torch")
    h.update(state["torch"].numpy().tobytes())
    for index, cuda_state in enumerate(state["cuda"]):
        h.update(f"cuda{index}".encode())
        h.update(cuda_state.cpu().numpy().tobytes())
    return h.hexdigest()


@contextmanager
def fork_process_streams(seed: int | None = None) -> Iterator[None]:
    """Run a block on its own streams: the process streams are put back afterwards.

    Args:
        seed: When given, the streams are seeded from it inside the block.

    Examples:
        >>> import torch
        >>> before = torch.get_rng_state()
        >>> with fork_process_streams(seed=3):
        ...     _ = torch.rand(5)
        >>> torch.equal(before, torch.get_rng_state())
        True
    """
    saved = capture_process_streams()
    try:
        if seed is not None:
            seed_process_streams(seed)
        yield
    finally:
        restore_process_streams(saved)


class StreamFork:
    """The process streams set aside while code between two hooks runs on streams seeded from its own seed.

    :func:`fork_process_streams` for a block that spans hooks (``on_validation_start`` ... ``on_validation_end``):
    :meth:`begin` saves the streams and seeds them, :meth:`end` puts the saved ones back. A ``begin`` while a fork
    is open does nothing (a nested loop keeps the outer fork's streams).

    Examples:
        >>> import torch
        >>> fork, before = StreamFork(), torch.get_rng_state()
        >>> fork.begin(seed=5); _ = torch.rand(3); fork.end()
        >>> torch.equal(before, torch.get_rng_state())
        True
    """

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None  # the streams set aside, while a fork is open

    def begin(self, seed: int) -> None:
        """Set the process streams aside and seed them from ``seed``, unless a fork is already open."""
        if self.saved is None:
            self.saved = capture_process_streams()
            seed_process_streams(seed)

    def end(self) -> None:
        """Put the streams set aside back (nothing when no fork is open)."""
        if self.saved is not None:
            saved, self.saved = self.saved, None
            restore_process_streams(saved)


def check_restored(saved: dict[str, Any]) -> None:
    """Recompute the fingerprint of the live streams after a restore and compare it with the saved one.

    Raises:
        CorruptStateError: a stream did not come back as saved.
    """
    live = capture_process_streams()
    if not live["cuda"]:
        live["cuda"] = saved["cuda"]  # CUDA not started here: its saved states wait in torch's lazy queue
    if digest_process_streams(live) != digest_process_streams(saved):
        raise CorruptStateError("the RNG streams restored from the checkpoint differ from the saved ones")
