"""Seed only the process streams a dataset's samples draw from, and prove in O(1) that the others did not move.

Sample-keyed access must give every sample the values it would get with python, numpy and torch all seeded from
its key. Seeding python costs ~4 us, numpy ~1.3 us, torch ~1 us through the library calls (python and numpy ~0.5 us
together through :mod:`lightning_repro.data._seedkernel`, a batch at a time, when it is in use: ``_fastrng.NATIVE``);
a dataset whose transforms draw from torch only (torchvision) needs one of the three. So each
:class:`~lightning_repro.data.keyed.KeyedDataset` learns, per process, which streams its samples draw from (``used``,
a mask of :data:`PYTHON` and :data:`NUMPY`; torch is always seeded: its position cannot be read without copying
its state, which costs as much as seeding it):

* the first sample a dataset loads in a process is loaded with every stream seeded, and ``used`` is what it
  moved (the raw states compared with those just after seeding: a draw always changes them);
* then a stream in ``used`` is seeded from the sample's key before each sample, exactly as before;
* a stream not in ``used`` is *armed* instead: its read position (python's ``index``, numpy's ``pos``) is set to
  0, a value no draw leaves behind (after any draw it is at least 1, even after a refill of the whole state),
  and its cached gaussian is cleared, so that a gaussian must draw too. After the sample one int read per armed
  stream says whether it was drawn from;
* when one was, the sample is loaded again with that stream seeded as well, and the stream joins ``used`` for
  every later sample of this dataset in this process.

A sample's value depends only on the streams it draws from, and those are always seeded from its key, so the
result is bitwise that of seeding every stream before every sample, whatever was learned in which process
(``num_workers``, resume). The price of learning: a sample that draws from a stream none before it (in that
process) drew from is loaded twice (``__getitem__`` runs again); a dataset whose every sample draws from the same
streams never is. A sample that reads a stream's state without drawing (``getstate()``,
``get_state()``), or draws and then puts the state back itself, is not seen: such a dataset should keep every
stream seeded (``LIGHTNING_REPRO_PYTHON_RAW=0`` and ``LIGHTNING_REPRO_NUMPY_RAW=0``).

Arming overwrites a position. In the main process the batch's :func:`~lightning_repro.data.fastrng.capture_fast` /
:func:`~lightning_repro.data.fastrng.restore_fast` put it back; in a dataloader worker nothing draws from the process
streams between two keyed calls (a ``collate_fn`` other than torch's default runs seeded). A stream whose raw
layout was not found (or whose raw path is turned off) cannot be armed: it is seeded before every sample.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

from lightning_repro.data import fastrng as _fastrng

__all__ = ["ALL", "NUMPY", "PYTHON", "UNKNOWN", "initial_usage", "load_samples"]

log = logging.getLogger(__name__)

PYTHON = 1
"""Python's ``random`` in a usage mask."""
NUMPY = 2
"""numpy's global generator in a usage mask."""
ALL = PYTHON | NUMPY
"""Every stream that can be left out: the mask of a dataset that draws from all of them."""
UNKNOWN = -1
"""The mask of a dataset that loaded no sample yet in this process: the next sample is a probe."""

_py_seed, _py_inst, _np_seed, _torch_seed = _fastrng.seeders()
_torch_set_state = _fastrng._torch_set_state
_native = _fastrng.NATIVE
_py_index = ctypes.c_int.from_address(_fastrng.PYTHON_RAW[0]) if _fastrng.PYTHON_RAW is not None else None
_np_pos = ctypes.c_int.from_address(_fastrng.NUMPY_RAW[0] + 2496) if _fastrng.NUMPY_RAW is not None else None
_np_gauss = ctypes.c_int.from_address(_fastrng.NUMPY_RAW[1]) if _fastrng.NUMPY_RAW is not None else None


def _unarmable() -> int:
    return (0 if _py_index is not None else PYTHON) | (0 if _np_pos is not None else NUMPY)


def initial_usage() -> int:
    """The mask a dataset starts with: :data:`UNKNOWN`, or :data:`ALL` when no stream can be armed."""
    return ALL if _unarmable() == ALL else UNKNOWN


def _probe(dataset: Any, index: Any, z: int) -> tuple[Any, int]:
    """``dataset[index]`` with every stream seeded; the mask of the streams it moved (and those never armed)."""
    _seed(ALL, z)
    python = ctypes.string_at(*_fastrng.PYTHON_RAW) if _fastrng.PYTHON_RAW is not None else None
    numpy = ctypes.string_at(_fastrng.NUMPY_RAW[0], 2500) if _fastrng.NUMPY_RAW is not None else None
    item = dataset[index]
    used = _unarmable()
    if python is not None and ctypes.string_at(*_fastrng.PYTHON_RAW) != python:  # type: ignore[misc]
        used |= PYTHON
    if numpy is not None and ctypes.string_at(_fastrng.NUMPY_RAW[0], 2500) != numpy:  # type: ignore[index]
        used |= NUMPY
    return item, used


def _arm(unused: int) -> None:
    if unused & PYTHON:
        _py_index.value = 0  # type: ignore[union-attr]
        _py_inst.gauss_next = None
    if unused & NUMPY:
        _np_pos.value = 0  # type: ignore[union-attr]
        _np_gauss.value = 0  # type: ignore[union-attr]  # has_gauss: a gaussian must draw


def _moved(unused: int) -> int:
    """The armed streams a sample drew from: one int read each."""
    moved = 0
    if unused & PYTHON and _py_index.value:  # type: ignore[union-attr]
        moved |= PYTHON
    if unused & NUMPY and _np_pos.value:  # type: ignore[union-attr]
        moved |= NUMPY
    return moved


def _seed(used: int, z: int) -> None:
    if used & PYTHON:
        _py_seed(_py_inst, z)
        _py_inst.gauss_next = None  # random.seed() clears it too
    if used & NUMPY:
        _np_seed((z ^ (z >> 32)) & 0xFFFFFFFF)  # seeding.fold_seed32, inlined
    _torch_seed(z)


def _load_learning(dataset: Any, index: Any, z: int, used: int) -> tuple[Any, int]:
    """``dataset[index]`` with the ``used`` streams seeded from ``z`` and the others armed, until none moved."""
    while True:
        _arm(ALL & ~used)
        _seed(used, z)
        item = dataset[index]
        moved = _moved(ALL & ~used)
        if not moved:
            return item, used
        used |= moved
        log.debug(f"{type(dataset).__name__}[{index!r}] draws from stream mask {moved}: seeded for every sample now")


def load_samples(dataset: Any, indices: Sequence[Any], seeds: Sequence[int], used: int) -> tuple[list[Any], int]:
    """``[dataset[i] for i in indices]``, each on its sample's streams, seeding only the ``used`` ones (see above).

    Args:
        dataset: The user's map-style dataset.
        indices: The sample indices.
        seeds: Each sample's seed (:func:`~lightning_repro.streams.item_seeds`).
        used: The streams known to be drawn from (a mask of :data:`PYTHON` and :data:`NUMPY`).

    Returns:
        The samples, and ``used`` with the streams learned while loading them.
    """
    if len(indices) != len(seeds):
        raise ValueError(f"{len(indices)} indices but {len(seeds)} seeds")
    data: list[Any] = []
    if used == UNKNOWN and len(indices):
        item, used = _probe(dataset, indices[0], seeds[0])
        data.append(item)
        indices, seeds = indices[1:], seeds[1:]
    if not len(indices):
        return data, used
    if used == ALL:
        _load_all(dataset, indices, seeds, data)
        return data, used
    return data, _load_some(dataset, indices, seeds, used, data)


def _load_all(dataset: Any, indices: Sequence[Any], seeds: Sequence[int], data: list[Any]) -> None:
    """The hot loop when every stream is drawn from: each sample's streams seeded, nothing armed."""
    append = data.append
    py_inst, torch_seed = _py_inst, _torch_seed
    if _native is not None and _fastrng.TORCH_RAW:  # all three written in place by the kernel (_fastrng.TORCH_RAW)
        states, put = _native.states_raw(seeds), _native.put_raw
        for k, index in enumerate(indices):
            put(states, k)
            py_inst.gauss_next = None  # random.seed() clears it too
            append(dataset[index])
        return
    if _native is not None:  # python's and numpy's (and torch's) states of the whole batch at once (_seedkernel)
        room = _fastrng.take_torch_states(len(seeds))
        states, put = _native.states(seeds, None if room is None else room.arrays), _native.put
        if room is None:
            for k, (index, z) in enumerate(zip(indices, seeds, strict=True)):
                put(states, k)
                py_inst.gauss_next = None  # random.seed() clears it too
                torch_seed(z)
                append(dataset[index])
            return
        set_state = _torch_set_state
        try:
            for k, (index, torch_state) in enumerate(zip(indices, room.tensors, strict=False)):
                put(states, k)
                py_inst.gauss_next = None
                set_state(torch_state)  # as torch_seed(seeds[k]): checked at import (_fastrng.TORCH_KERNEL)
                append(dataset[index])
        finally:
            _fastrng.torch_states_back(room)
        return
    py_seed, np_seed = _py_seed, _np_seed
    for index, z in zip(indices, seeds, strict=True):
        py_seed(py_inst, z)
        py_inst.gauss_next = None
        np_seed((z ^ (z >> 32)) & 0xFFFFFFFF)  # seeding.fold_seed32, inlined
        torch_seed(z)
        append(dataset[index])


def _load_some(dataset: Any, indices: Sequence[Any], seeds: Sequence[int], used: int, data: list[Any]) -> int:
    """The loop when some stream is not (yet) drawn from: it is armed and watched; returns the ``used`` learned."""
    append = data.append
    py_seed, py_inst, np_seed, torch_seed = _py_seed, _py_inst, _np_seed, _torch_seed
    py_index, np_pos = _py_index, _np_pos
    watch_py = py_index is not None and not used & PYTHON
    watch_np = np_pos is not None and not used & NUMPY
    raw = _native is not None and _fastrng.TORCH_RAW  # the kernel writes torch's generator too
    # the seeded streams' states of the whole batch at once, written stream by stream (the others stay armed)
    states = _states(seeds, raw) if _native is not None and (raw or not watch_py or not watch_np) else None
    _arm(ALL & ~used)
    for k, (index, z) in enumerate(zip(indices, seeds, strict=True)):
        if states is not None:
            mask = (0 if watch_py else PYTHON) | (0 if watch_np else NUMPY)
            if raw:
                _native.put_raw(states, k, mask | _TORCH)
            else:
                _native.put(states, k, mask)
            if not watch_py:
                py_inst.gauss_next = None
        else:
            if not watch_py:
                py_seed(py_inst, z)
                py_inst.gauss_next = None
            if not watch_np:
                np_seed((z ^ (z >> 32)) & 0xFFFFFFFF)
        if not raw:
            torch_seed(z)
        item = dataset[index]
        if (watch_py and py_index.value) or (watch_np and np_pos.value):  # type: ignore[union-attr]
            item, used = _load_learning(dataset, index, z, used | _moved(ALL & ~used))
            watch_py, watch_np = watch_py and not used & PYTHON, watch_np and not used & NUMPY
            _arm(ALL & ~used)
            if states is None and _native is not None:
                states = _states(seeds, raw)
        append(item)
    return used


_TORCH = 4  # torch's bit in the kernel's put_raw() mask


def _states(seeds: Sequence[int], raw: bool) -> bytes:
    return _native.states_raw(seeds) if raw else _native.states(seeds)  # type: ignore[no-any-return,union-attr]
