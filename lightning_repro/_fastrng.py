"""The fast save/restore and seeding of the process streams, for the per-batch hot path.

:mod:`lightning_repro.rng` captures the process streams as checkpoint-safe tensors; this module keeps them
as opaque values for the microseconds between loading a batch in the main process and putting the streams
back. numpy's ``get_state()``/``set_state()`` cost ~70 us together, more than everything else per batch, so
the numpy state is copied as raw memory when its layout checks out (:func:`numpy_raw_layout`). Setting
``LIGHTNING_REPRO_NUMPY_RAW=0`` in the environment (read once, at import) turns the raw copy off: numpy's
public API is used, slower and equal in effect.
"""

from __future__ import annotations

import _random
import os
import random
from typing import Any

import numpy as np
import torch

from lightning_repro.seeding import fold_seed32

__all__ = [
    "NUMPY_RAW",
    "NUMPY_RAW_ENV",
    "FastState",
    "capture_fast",
    "numpy_raw_layout",
    "numpy_raw_wanted",
    "restore_fast",
    "seed_sample",
    "seeders",
]

NUMPY_RAW_ENV = "LIGHTNING_REPRO_NUMPY_RAW"
"""The environment variable that turns the raw-memory numpy path off when ``0`` (``false``, ``no``, ``off``)."""

_py_seed = _random.Random.seed
_py_inst = random._inst  # type: ignore[attr-defined]  # the generator behind the random module's functions
_np_seed = np.random.mtrand._rand.seed  # the RandomState behind numpy's global functions
_torch_gen = torch.default_generator

FastState = tuple[Any, Any, torch.Tensor]


def seeders() -> tuple[Any, Any, Any, Any]:
    """``(python seed, python generator, numpy seed, torch seed)``: for a loop that inlines :func:`seed_sample`."""
    return _py_seed, _py_inst, _np_seed, _torch_gen.manual_seed


def seed_sample(seed: int) -> None:
    """Seed python, numpy and torch CPU from a 64-bit ``seed``: one sample's streams."""
    _py_seed(_py_inst, seed)
    _py_inst.gauss_next = None  # type: ignore[attr-defined]  # random.seed() clears it too
    _np_seed(fold_seed32(seed))
    _torch_gen.manual_seed(seed)


def numpy_raw_wanted(value: str | None) -> bool:
    """Whether the value of ``LIGHTNING_REPRO_NUMPY_RAW`` allows the raw-memory numpy path (unset: yes).

    Raises:
        ValueError: ``value`` is not one of ``1``, ``true``, ``yes``, ``on``, ``0``, ``false``, ``no``, ``off``.
    """
    if value is None or value.strip().lower() in ("", "1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"`{NUMPY_RAW_ENV}` must be 1 or 0 (true/false, yes/no, on/off), got {value!r};"
        f" set `{NUMPY_RAW_ENV}=0` to turn the raw-memory numpy path off, or unset it"
    )


def numpy_raw_layout() -> tuple[int, int, int] | None:
    """Where numpy's global generator keeps its state in memory, checked, or None to use the slow API.

    The Mersenne Twister words and position sit behind ``bit_generator.ctypes.state_address`` (public API,
    2500 bytes); the cached Box-Muller value (``has_gauss``, ``gauss``) sits inside the RandomState object.
    Its offset is found by writing known values with ``set_state`` and reading them back; every
    mismatch falls back to the public API, so a numpy with another layout is slower, never wrong.
    """
    import ctypes
    import struct

    rs = np.random.mtrand._rand
    try:
        address = int(rs._bit_generator.ctypes.state_address)
        saved: Any = rs.get_state(legacy=True)
        try:
            markers = ((1, 1.2345678901234567), (0, -7.5), (1, 3.0e-300))
            rs.set_state(("MT19937", saved[1], saved[2], *markers[0]))
            raw = ctypes.string_at(id(rs), type(rs).__basicsize__)  # read only the object's own memory
            offset = raw.find(struct.pack("<d", markers[0][1]))
            if offset < 8 or offset % 8 or offset + 8 > type(rs).__basicsize__:
                return None
            for has_gauss, gauss in markers:
                rs.set_state(("MT19937", saved[1], saved[2], has_gauss, gauss))
                flag, value = struct.unpack("<iid", ctypes.string_at(id(rs) + offset - 8, 16))[0::2]
                if (flag, value) != (has_gauss, gauss):
                    return None
            words = np.asarray(saved[1], dtype=np.uint32).tobytes() + struct.pack("<i", saved[2])
            rs.set_state(saved)
            if ctypes.string_at(address, 2500) != words:
                return None
        finally:
            rs.set_state(saved)
        return address, id(rs) + offset - 8, 2500
    except Exception:  # any surprise: use the public API
        return None


NUMPY_RAW = numpy_raw_layout() if numpy_raw_wanted(os.environ.get(NUMPY_RAW_ENV)) else None
"""The checked raw layout of numpy's global generator, or None: the public API is used."""


def _numpy_capture() -> Any:
    if NUMPY_RAW is None:
        return np.random.get_state()
    import ctypes

    address, aug, size = NUMPY_RAW
    return ctypes.string_at(address, size), ctypes.string_at(aug, 16)


def _numpy_restore(state: Any) -> None:
    if NUMPY_RAW is None:
        np.random.set_state(state)
        return
    import ctypes

    address, aug, size = NUMPY_RAW
    ctypes.memmove(address, state[0], size)
    ctypes.memmove(aug, state[1], 16)


def capture_fast() -> FastState:
    """The process streams (python, numpy, torch CPU) as opaque values, for :func:`restore_fast` in this process."""
    return random.getstate(), _numpy_capture(), _torch_gen.get_state()


def restore_fast(state: FastState) -> None:
    """Put back the process streams :func:`capture_fast` returned."""
    random.setstate(state[0])
    _numpy_restore(state[1])
    _torch_gen.set_state(state[2])
