"""Python's and numpy's seeded Mersenne Twister states, a batch of samples at a time (``_seedkernel.c``)."""

from collections.abc import Sequence
from typing import Any

SAMPLE_BYTES: int
"""Bytes per sample in :func:`states`: python's raw state (2,500), then numpy's (2,500)."""

TORCH_MIN_BYTES: int
"""The fewest bytes a torch buffer of :func:`states` takes: torch's state up to its words (5,016)."""

def states(seeds: Sequence[int], torch: Sequence[Any] | None = None, /) -> bytes:
    """Python's and numpy's raw states after seeding from each seed (each in ``[0, 2**64)``).

    ``torch``: writable buffers, one per seed; buffer ``k`` gets what torch's ``get_state()`` returns after
    ``manual_seed(seeds[k])`` (zeros after its words), for ``set_state()``.
    """

def put(states: bytes, k: int, streams: int = 3, /) -> None:
    """Write sample ``k`` of ``states`` into python's (``streams & 1``) and numpy's (``streams & 2``) generators."""

def seed(z: int, /) -> None:
    """Seed python's and numpy's global generators from one sample seed."""

def configure(python_state: int, numpy_state: int, numpy_aug: int, /) -> None:
    """The checked addresses of the generators' raw states; 0 unsets them."""

def capture() -> bytes:
    """Python's and numpy's raw states, numpy's cached gaussian included (not python's ``gauss_next``)."""

def restore(captured: bytes, /) -> None:
    """Put back the states :func:`capture` returned."""

def item_seeds(pass_sample_seed: int, indices: Sequence[int], /) -> list[int]:
    """``streams.item_seeds`` for indices that are exactly ``int`` (TypeError for any other)."""
