"""The fast save/restore and seeding of the process streams, for the per-batch hot path.

:mod:`lightning_repro.rng` captures the process streams as checkpoint-safe tensors; this module keeps them
as opaque values for the microseconds between loading a batch in the main process and putting the streams
back. numpy's ``get_state()``/``set_state()`` cost ~70 us together and python's ``getstate()`` ~6 us (a tuple of
625 ints), more than everything else per batch, so both states are copied as raw memory when their layout
checks out (:func:`numpy_raw_layout`, :func:`python_raw_layout`). The same layouts give the positions that
:mod:`lightning_repro.data.usage` reads to seed only the streams a sample draws from. Setting
``LIGHTNING_REPRO_NUMPY_RAW=0`` (or ``LIGHTNING_REPRO_PYTHON_RAW=0``) in the environment (read once, at import)
turns the raw path of that stream off: the public API is used, slower and equal in effect, and the stream is
seeded before every sample.

Seeding python's and numpy's streams from a sample's key costs ~5 us through the library calls (python's
``init_by_array`` alone ~3.8 us), most of the per-sample cost. The optional C extension
:mod:`lightning_repro.data._seedkernel` computes the same states for a whole batch at once (the samples' recurrences
side by side in vector lanes, ~0.5 us per sample for both streams) and writes them into the raw layouts above.
It is used when it was built, both raw layouts were found, and its states equal the library calls' for a set of
keys checked at import (:data:`NATIVE`); ``LIGHTNING_REPRO_NATIVE=0`` turns it off. Without it the library calls
seed the streams: the same values, slower.

torch's ``manual_seed`` (~1.5 us: 623 dependent steps) is the other half of a sample's seeding. The kernel makes
torch's states of a batch too, in the same vector lanes, as the bytes ``get_state()`` returns after ``manual_seed``;
each sample's is then put in place with ``set_state()`` (~0.3 us), when those states equal ``manual_seed``'s for the
keys checked at import (:data:`TORCH_KERNEL`), else through ``manual_seed``. Where torch's generator's own memory
was found and checked (:mod:`lightning_repro.data.torchraw`, :data:`TORCH_RAW`), the kernel writes each sample's
torch state there itself and :func:`capture_fast`/:func:`restore_fast` copy it with python's and numpy's: no
``get_state()`` tensor, no ``set_state()`` per sample (``LIGHTNING_REPRO_TORCH_RAW=0`` turns it off).
"""

from __future__ import annotations

import _random
import ctypes
import os
import random
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lightning_repro import streams
from lightning_repro.data import torchraw as _torchraw
from lightning_repro.data import torchstates as _torchstates
from lightning_repro.data.rawlayout import (
    NUMPY_RAW_ENV,
    PYTHON_RAW_ENV,
    numpy_raw_layout,
    numpy_raw_wanted,
    python_raw_layout,
)
from lightning_repro.data.torchraw import TORCH_RAW_ENV
from lightning_repro.data.torchstates import TorchStates, torch_states_back
from lightning_repro.seeding import fold_seed32

__all__ = [
    "NATIVE",
    "NATIVE_ENV",
    "NUMPY_RAW",
    "NUMPY_RAW_ENV",
    "PYTHON_RAW",
    "PYTHON_RAW_ENV",
    "TORCH_KERNEL",
    "TORCH_RAW",
    "TORCH_RAW_ENV",
    "FastState",
    "ItemSeeder",
    "TorchStates",
    "capture_fast",
    "item_putters",
    "item_seeds",
    "native_status",
    "numpy_raw_layout",
    "numpy_raw_wanted",
    "python_raw_layout",
    "restore_fast",
    "seed_sample",
    "seeders",
    "take_torch_states",
    "torch_states_back",
]

NATIVE_ENV = "LIGHTNING_REPRO_NATIVE"
"""``0`` turns the compiled seeding kernel off: python and numpy are seeded through the library calls."""

_py_seed = _random.Random.seed
_py_inst = random._inst  # type: ignore[attr-defined]  # the generator behind the random module's functions
_np_seed = np.random.mtrand._rand.seed  # the RandomState behind numpy's global functions
_torch_gen = torch.default_generator
_torch_set_state = _torch_gen.set_state

FastState = tuple[Any, Any, torch.Tensor]



def seeders() -> tuple[Any, Any, Any, Any]:
    """``(python seed, python generator, numpy seed, torch seed)``: for a loop that inlines :func:`seed_sample`."""
    return _py_seed, _py_inst, _np_seed, _torch_gen.manual_seed


def item_putters() -> tuple[Any, Any, Any]:
    """``(kernel put, python generator, torch set_state)``: for a loop that inlines :meth:`ItemSeeder.seed`.

    Valid for a block the seeder made :attr:`ItemSeeder.whole` (then the kernel is in use).
    """
    return (None if NATIVE is None else NATIVE.put), _py_inst, _torch_set_state


def seed_sample(seed: int) -> None:
    """Seed python, numpy and torch CPU from a 64-bit ``seed``: one sample's streams."""
    if NATIVE is not None and TORCH_RAW:
        NATIVE.seed_raw(seed)
        _py_inst.gauss_next = None  # type: ignore[attr-defined]
        return
    if NATIVE is not None:
        NATIVE.seed(seed)
    else:
        _py_seed(_py_inst, seed)
        _np_seed(fold_seed32(seed))
    _py_inst.gauss_next = None  # type: ignore[attr-defined]  # random.seed() clears it too
    _torch_gen.manual_seed(seed)


class ItemSeeder:
    """``seed_sample(item_seed(key, k))`` for the items k = 0, 1, ... of a stream (an iterable's pass, one worker).

    The next :attr:`BLOCK` items' seeds and, with the kernel, their python and numpy states are made at once (the
    kernel's vector lanes, as a map-style batch is seeded), so each item only puts its states in place: the same
    values as :func:`seed_sample`, at a fraction of the cost of seeding one item at a time.
    """

    BLOCK = 32

    def __init__(self, key: int) -> None:
        self.key = key
        self.start = 0
        self.end = 0  # the block holds the items start..end-1
        self.seeds: list[int] = []
        self.states: Any = None
        self.put: Any = None  # the kernel's put for `states` (put_raw when they hold torch's too: TORCH_RAW)
        self.torch: TorchStates | None = None  # the block's torch states (its own: a block outlives a batch)
        # the kernel made all three streams' states of the block (torch's too): what a caller's inlined copy of
        # seed() puts in place for an item k in start..end-1, as seed() does (see data/streaming.py)
        self.whole = False
        self.tensors: list[torch.Tensor] = []  # then torch's states to set_state(), item start + j's at j (or none)

    def seed(self, k: int) -> int:
        """Seed python, numpy and torch CPU for item ``k``; return its seed."""
        j = k - self.start
        if not 0 <= j < len(self.seeds):
            self.start, j = k, 0
            self.seeds = item_seeds(self.key, list(range(k, k + self.BLOCK)))
            self.end = k + len(self.seeds)
            self._make_states()
        z = self.seeds[j]
        if self.states is None:
            seed_sample(z)
            return z
        self.put(self.states, j)
        _py_inst.gauss_next = None  # type: ignore[attr-defined]  # random.seed() clears it too
        if self.tensors:
            _torch_set_state(self.tensors[j])
        elif not self.whole:
            _torch_gen.manual_seed(z)
        return z

    def _make_states(self) -> None:
        if NATIVE is None:
            self.states, self.whole, self.tensors = None, False, []
        elif TORCH_RAW:
            self.states, self.put, self.whole, self.tensors = NATIVE.states_raw(self.seeds), NATIVE.put_raw, True, []
        else:
            if TORCH_KERNEL and self.torch is None:
                self.torch = TorchStates(self.BLOCK)
            self.states = NATIVE.states(self.seeds, None if self.torch is None else self.torch.arrays)
            self.put, self.whole = NATIVE.put, self.torch is not None
            self.tensors = self.torch.tensors if self.torch is not None else []


def take_torch_states(n: int) -> TorchStates | None:
    """Room for ``n`` torch states for one batch (:func:`torch_states_back` after it), or None: seed torch itself.

    None unless the kernel's torch states are in use (:data:`TORCH_KERNEL`).
    """
    return _torchstates.take(n, ItemSeeder.BLOCK) if TORCH_KERNEL else None


NUMPY_RAW = numpy_raw_layout() if numpy_raw_wanted(os.environ.get(NUMPY_RAW_ENV)) else None
"""The checked raw layout of numpy's global generator, or None: the public API is used."""


PYTHON_RAW = python_raw_layout() if numpy_raw_wanted(os.environ.get(PYTHON_RAW_ENV), PYTHON_RAW_ENV) else None
"""The checked raw layout of python's ``random`` generator, or None: the public API is used."""

NATIVE: Any = None  # the checked compiled kernel: set at the end of this module, once it was checked
TORCH_KERNEL = False  # the kernel's torch states are used (checked at import): set at the end of this module
TORCH_RAW = False  # the kernel writes torch's generator itself (checked at import): set at the end of this module


def _numpy_capture() -> Any:
    if NUMPY_RAW is None:
        return np.random.get_state()
    address, aug, size = NUMPY_RAW
    return ctypes.string_at(address, size), ctypes.string_at(aug, 16)


def _numpy_restore(state: Any) -> None:
    if NUMPY_RAW is None:
        np.random.set_state(state)
        return
    address, aug, size = NUMPY_RAW
    ctypes.memmove(address, state[0], size)
    ctypes.memmove(aug, state[1], 16)


def _python_capture() -> Any:
    if PYTHON_RAW is None:
        return random.getstate()
    return ctypes.string_at(*PYTHON_RAW), _py_inst.gauss_next  # type: ignore[attr-defined]


def _python_restore(state: Any) -> None:
    if PYTHON_RAW is None:
        random.setstate(state)
        return
    ctypes.memmove(PYTHON_RAW[0], state[0], PYTHON_RAW[1])
    _py_inst.gauss_next = state[1]  # type: ignore[attr-defined]


def capture_fast() -> FastState:
    """The process streams (python, numpy, torch CPU) as opaque values, for :func:`restore_fast` in this process."""
    if NATIVE is not None:  # python's and numpy's raw states in one call (torch's too: TORCH_RAW); None marks the form
        torch_state = None if TORCH_RAW else _torch_gen.get_state()
        return (NATIVE.capture(), _py_inst.gauss_next), None, torch_state  # type: ignore[attr-defined,return-value]
    return _python_capture(), _numpy_capture(), _torch_gen.get_state()


def restore_fast(state: FastState) -> None:
    """Put back the process streams :func:`capture_fast` returned."""
    if state[1] is None:
        NATIVE.restore(state[0][0])
        _py_inst.gauss_next = state[0][1]  # type: ignore[attr-defined]
        if state[2] is None:  # torch's was in the kernel's capture (TORCH_RAW)
            return
    else:
        _python_restore(state[0])
        _numpy_restore(state[1])
    _torch_gen.set_state(state[2])


def item_seeds(pass_sample_seed: int, indices: Sequence[Any]) -> list[int]:
    """:func:`~lightning_repro.streams.item_seeds`, computed by the kernel when every index is an ``int``."""
    if NATIVE is not None:
        try:
            return NATIVE.item_seeds(pass_sample_seed, indices)  # type: ignore[no-any-return]
        except TypeError:  # an index of another type (numpy ints, tuples, strings): hashed as streams does
            pass
    return streams.item_seeds(pass_sample_seed, indices)


def _raw_streams() -> bytes:
    """Python's and numpy's raw states as the kernel writes them (numpy's gaussian cache as its two fields)."""
    has_gauss, gauss = struct.unpack("<i4xd", ctypes.string_at(NUMPY_RAW[1], 16))  # type: ignore[index]
    return ctypes.string_at(*PYTHON_RAW) + ctypes.string_at(NUMPY_RAW[0], 2500) + struct.pack("<id", has_gauss, gauss)  # type: ignore[index,misc]


_KERNEL_CHECK_SEEDS = (0, 1, 2**32 - 1, 2**32, 2**64 - 1, *(((k + 1) * 0x9E3779B97F4A7C15) % 2**64 for k in range(12)))
"""17 keys: the edges of python's one- and two-word keys, then a wide pass of 16 and one sample alone."""


def native_kernel(wanted: str | None = None) -> Any:
    """The compiled seeding kernel, configured and checked against the library calls, or None (see the module).

    Args:
        wanted: The value of ``LIGHTNING_REPRO_NATIVE`` (None: unset, the kernel is wanted).
    """
    if PYTHON_RAW is None or NUMPY_RAW is None or not numpy_raw_wanted(wanted, NATIVE_ENV):
        return None
    try:
        import lightning_repro.data._seedkernel as _seedkernel
    except ImportError:  # not built (no C compiler where it was installed): the library calls seed the streams
        return None
    saved = _python_capture(), _numpy_capture()  # through the raw paths, without the kernel
    try:
        _seedkernel.configure(PYTHON_RAW[0], NUMPY_RAW[0], NUMPY_RAW[1])
        block = _seedkernel.states(_KERNEL_CHECK_SEEDS)
        for k, z in enumerate(_KERNEL_CHECK_SEEDS):
            _py_seed(_py_inst, z)
            _np_seed(fold_seed32(z))
            expected = _raw_streams()
            _seedkernel.put(block, k)
            batched = _raw_streams()
            _seedkernel.seed(z)
            if not expected == batched == _raw_streams():
                _seedkernel.configure(0, 0, 0)
                return None
        return _seedkernel
    except Exception:  # any surprise: the library calls
        _seedkernel.configure(0, 0, 0)
        return None
    finally:
        _python_restore(saved[0])
        _numpy_restore(saved[1])


def torch_kernel(kernel: Any) -> bool:
    """Whether the ``kernel``'s torch states equal ``manual_seed``'s for the keys checked at import (see the module)."""
    return _torchstates.kernel_agrees(kernel, _KERNEL_CHECK_SEEDS)


def torch_raw(kernel: Any, wanted: str | None = None) -> bool:
    """Whether the ``kernel`` writes torch's generator itself: its memory found and checked (``torchraw``).

    The check seeds every stream with the kernel (``seed_raw``); python's and numpy's global generators are put back
    as they were (``torchraw`` puts torch's back): importing the package moves no global stream.

    Args:
        kernel: The checked kernel, or None.
        wanted: The value of ``LIGHTNING_REPRO_TORCH_RAW`` (None: unset, wanted).
    """
    if not numpy_raw_wanted(wanted, TORCH_RAW_ENV):
        return False
    saved = random.getstate(), np.random.get_state()
    try:
        return _torchraw.kernel_agrees(kernel, _KERNEL_CHECK_SEEDS)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


def native_status() -> str:
    """Whether the seeding kernel is in use here, and if not why (for ``lightning-repro doctor``)."""
    if NATIVE is not None:
        if TORCH_RAW:
            return "in use (python, numpy and torch seeded a batch at a time, written in place)"
        if TORCH_KERNEL:
            return "in use (python, numpy and torch seeded a batch at a time)"
        return "in use (python and numpy seeded a batch at a time; torch through manual_seed)"
    wanted = os.environ.get(NATIVE_ENV)
    if wanted is not None and not numpy_raw_wanted(wanted, NATIVE_ENV):
        return f"off ({NATIVE_ENV}={wanted}): library calls, same values, slower"
    if PYTHON_RAW is None or NUMPY_RAW is None:
        return "not used: a generator's raw layout was not found here: library calls, same values, slower"
    try:
        import lightning_repro.data._seedkernel  # noqa: F401
    except ImportError:
        return "not built (no C compiler where lightning-repro was installed): library calls, same values, slower"
    return "not used: it disagreed with the library calls at import: library calls, same values"


NATIVE = native_kernel(os.environ.get(NATIVE_ENV))
"""The checked compiled kernel (``states``, ``put``, ``seed``), or None: python and numpy are seeded by the library."""
TORCH_KERNEL = torch_kernel(NATIVE)
"""Whether the kernel also makes torch's states (put in place with ``set_state``), checked against ``manual_seed``."""
TORCH_RAW = torch_raw(NATIVE, os.environ.get(TORCH_RAW_ENV))
"""Whether the kernel writes torch's generator in place and captures it (no ``set_state``/``get_state`` a batch)."""
