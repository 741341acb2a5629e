"""torch's CPU generator as raw memory, found and checked, for the seeding kernel's per-sample and per-batch paths.

``torch.default_generator.get_state()`` makes a new 5,056-byte tensor and ``set_state()`` checks and converts one
(about 1.5 and 0.6 us in a loop, several times that inside a fit, where the code is cold): a keyed batch in the
main process took the state twice and put it back 1 + n times (once per sample). The generator's engine
(``at::CPUGeneratorImpl``: ``seed`` u64, ``left`` i32, ``seeded`` bool, ``next`` u32, the 624 words as u32, then
the cached float and double normals as ``std::optional``, 2,544 bytes) sits in the C++ object behind the Python one.
:func:`engine_address` finds it: the object's pointer, then the engine by a known seed and its words, and the cached
normals right after it (set to known values, then cleared), all read through ``/proc/self/mem`` (an unreadable
address is an error there, never a crash) before anything is written; :func:`kernel_agrees` then checks everything
the kernel does with it against torch's own calls: a seeded state written as ``manual_seed`` leaves it
(both cached normals cleared), and the state taken and put back with both normals cached. Any difference, another
platform, or ``LIGHTNING_REPRO_TORCH_RAW=0``: ``get_state()``/``set_state()`` as before, the same values.

The writes skip the generator's mutex, as python's and numpy's raw paths skip their locks: they happen where the
library calls they replace would run, in the thread loading the batch.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["TORCH_RAW_ENV", "engine_address", "kernel_agrees"]

TORCH_RAW_ENV = "LIGHTNING_REPRO_TORCH_RAW"
"""``0`` turns the raw-memory path of torch's generator off: ``get_state()``/``set_state()``, the same values."""

_gen = torch.default_generator
_WORDS = 624
_ENGINE = 20 + 4 * _WORDS  # seed, left, seeded, next, the words
_MARK = 0x0123456789ABCDEF  # a seed whose 8 bytes do not occur by chance near the object's start
_SEARCH = 1024  # bytes of the C++ object searched for the engine's start
_RAW_SIZE = 2544  # the engine, then the cached float and double normals (the kernel's TORCH_RAW_BYTES)


def _read(address: int, size: int) -> bytes | None:
    """``size`` bytes at ``address`` of this process, or None where they cannot be read (no crash on a bad address)."""
    try:
        with open("/proc/self/mem", "rb", buffering=0) as mem:
            mem.seek(address)
            data = mem.read(size)
    except (OSError, OverflowError, ValueError):
        return None
    return data if data is not None and len(data) == size else None


def _words(state: torch.Tensor) -> bytes:
    """The 624 words of a ``get_state()`` (u64 each there) as the engine keeps them (u32)."""
    return struct.pack(f"<{_WORDS}I", *struct.unpack_from(f"<{_WORDS}Q", state.numpy().tobytes(), 24))


def engine_address() -> int | None:
    """The address of ``torch.default_generator``'s engine (its ``seed`` field), checked, or None (see the module)."""
    if not sys.platform.startswith("linux") or sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    head = _read(id(_gen), 24)  # PyObject_HEAD, then the at::Generator: one pointer to the C++ object
    if head is None or type(_gen).__basicsize__ < 24:
        return None
    (impl,) = struct.unpack_from("<Q", head, 16)
    saved = _gen.get_state()
    try:
        _gen.manual_seed(_MARK)
        expected = _words(_gen.get_state())
        memory = _read(impl, _SEARCH + _ENGINE)
        if memory is None:
            return None
        for offset in range(8, _SEARCH, 8):
            if struct.unpack_from("<Q", memory, offset)[0] != _MARK:
                continue
            left, seeded, next_ = struct.unpack_from("<iBxxxI", memory, offset + 8)
            if (left, seeded, next_) == (1, 1, 0) and memory[offset + 20 : offset + _ENGINE] == expected:
                return int(impl + offset) if _normals_at(impl + offset) else None
        return None
    finally:
        _gen.set_state(saved)


def _normals_at(engine: int) -> bool:
    """Whether the cached normals sit right after the engine (read only: nothing is written before this holds).

    ``std::optional<float>`` at +2520 (the value, its flag at +2524), ``std::optional<double>`` at +2528 (its flag at
    +2536): read with both set to known values (``set_state``), then cleared (``manual_seed``).
    """
    _cached_normals()
    state = _gen.get_state().numpy().tobytes()
    cached = _read(engine + _ENGINE, _RAW_SIZE - _ENGINE)
    _gen.manual_seed(_MARK)
    cleared = _read(engine + _ENGINE, _RAW_SIZE - _ENGINE)
    if cached is None or cleared is None or state[5040] != 1:
        return False
    float_ok = cached[4:8] == struct.pack("<f", 1.25) and cached[8] == 1 and cleared[8] == 0
    return float_ok and cached[12:20] == state[5024:5032] and cached[20] == 1 and cleared[20] == 0


def _cached_normals() -> None:
    """Leave torch's generator with both cached normals set (float and double), from its current state."""
    torch.randn(1, dtype=torch.float64)  # a scalar normal draws two and keeps one (the double cache)
    state = _gen.get_state().clone()
    raw = state.numpy()
    raw[5048:5052] = memoryview(struct.pack("<f", 1.25)).cast("B")  # next_float_normal_sample
    raw[5052] = 1  # ... is valid
    _gen.set_state(state)


def kernel_agrees(kernel: Any, seeds: Sequence[int]) -> bool:
    """Configure the ``kernel`` with torch's engine and check what it writes and keeps; unconfigured on any difference.

    Checked for each of the ``seeds`` (from a state with both normals cached): ``put_raw`` of ``states_raw`` and
    ``seed_raw`` leave ``get_state()``, ``initial_seed()`` and the next 700 draws (a refill included) as
    ``manual_seed`` does; ``capture()`` then ``restore()`` gives back a state with both normals cached.
    """
    if kernel is None or _gen.get_state().numel() != 5056:
        return False
    address = engine_address()
    if address is None:
        return False
    saved = _gen.get_state()
    try:
        kernel.configure_torch(address)
        block = kernel.states_raw(list(seeds))
        for k, z in enumerate(seeds):
            thorough = k in (0, 1, len(seeds) - 1)  # the draws and the capture: for a wide pass's and a lone sample
            _gen.manual_seed(z)
            expected = _gen.get_state()
            draws = torch.rand(700) if thorough else None
            for how in ("put_raw", "seed_raw"):
                if thorough:
                    _cached_normals()
                else:
                    torch.rand(1)  # moved, so that the write has something to overwrite
                if how == "put_raw":
                    kernel.put_raw(block, k, 4)  # torch's alone
                else:
                    kernel.seed_raw(z)
                if not torch.equal(_gen.get_state(), expected) or _gen.initial_seed() != z:
                    raise ValueError(f"{how}({z})")
                if draws is not None and not torch.equal(torch.rand(700), draws):
                    raise ValueError(f"{how}({z}): draws")
            if thorough:
                _cached_normals()
                cached = _gen.get_state()
                taken = kernel.capture()
                _gen.manual_seed(z ^ 1)
                torch.rand(3)
                kernel.restore(taken)
                if not torch.equal(_gen.get_state(), cached):
                    raise ValueError(f"capture/restore ({z})")
        return True
    except Exception:  # any surprise: get_state()/set_state()
        kernel.configure_torch(0)
        return False
    finally:
        _gen.set_state(saved)

