"""Where python's ``random`` and numpy's global generator keep their states in memory, found and checked.

:mod:`lightning_repro.data.fastrng` copies both states as raw memory when these layouts check out (a few
microseconds a batch instead of ~70 us for numpy's ``get_state()``/``set_state()``), and the seeding kernel writes
them; every mismatch falls back to the public API. torch's generator has its own: :mod:`lightning_repro.data.torchraw`.
"""

from __future__ import annotations

import _random
import ctypes
import random
import struct
from typing import Any

import numpy as np

__all__ = ["NUMPY_RAW_ENV", "PYTHON_RAW_ENV", "numpy_raw_layout", "numpy_raw_wanted", "python_raw_layout"]

NUMPY_RAW_ENV = "LIGHTNING_REPRO_NUMPY_RAW"
"""The environment variable that turns the raw-memory numpy path off when ``0`` (``false``, ``no``, ``off``)."""
PYTHON_RAW_ENV = "LIGHTNING_REPRO_PYTHON_RAW"
"""The same for python's ``random``: ``0`` turns its raw-memory path off."""

_py_inst = random._inst  # type: ignore[attr-defined]  # the generator behind the random module's functions


def numpy_raw_wanted(value: str | None, name: str = NUMPY_RAW_ENV) -> bool:
    """Whether the value of ``LIGHTNING_REPRO_NUMPY_RAW`` (or the variable ``name``) allows the raw path (unset: yes).

    Raises:
        ValueError: ``value`` is not one of ``1``, ``true``, ``yes``, ``on``, ``0``, ``false``, ``no``, ``off``.
    """
    if value is None or value.strip().lower() in ("", "1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"`{name}` must be 1 or 0 (true/false, yes/no, on/off), got {value!r};"
        f" set `{name}=0` to turn that raw-memory path off, or unset it"
    )


def numpy_raw_layout() -> tuple[int, int, int] | None:
    """Where numpy's global generator keeps its state in memory, checked, or None to use the slow API.

    The Mersenne Twister words and position sit behind ``bit_generator.ctypes.state_address`` (public API,
    2500 bytes); the cached Box-Muller value (``has_gauss``, ``gauss``) sits inside the RandomState object.
    Its offset is found by writing known values with ``set_state`` and reading them back; every
    mismatch falls back to the public API, so a numpy with another layout is slower, never wrong.
    """
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


def python_raw_layout() -> tuple[int, int] | None:
    """Where python's ``random`` keeps its Mersenne Twister in memory, checked, or None to use the slow API.

    CPython's ``_random.Random`` holds ``int index`` followed by ``uint32_t state[624]``: 2500 bytes. Their
    offset is found by writing two known states with ``setstate`` and reading them back; every mismatch falls
    back to the public API. The cached gaussian (``gauss_next``) is a plain attribute, handled apart.

    Returns:
        ``(address of index, 2500)``, or None.
    """
    inst = _py_inst
    try:
        size = _random.Random.__basicsize__
        saved = inst.getstate()
        try:
            offset = -1
            for salt in (1, 7):
                words = tuple((salt * 2654435761 * (k + 1)) & 0xFFFFFFFF for k in range(624))
                index = 17 * salt
                inst.setstate((saved[0], (*words, index), None))
                expected = struct.pack("<i624I", index, *words)
                found = ctypes.string_at(id(inst), size).find(expected)
                if found < 16 or found % 4 or (offset >= 0 and found != offset):
                    return None
                offset = found
        finally:
            inst.setstate(saved)
        return id(inst) + offset, 2500
    except Exception:  # any surprise: use the public API
        return None
