"""Room for torch CPU generator states that the seeding kernel writes, put in place with ``set_state()``.

:mod:`lightning_repro.data.fastrng` asks the kernel for a batch's (or an item block's) torch states as the bytes
``get_state()`` returns after ``manual_seed(z)``; each sample's is then put in place with ``set_state()`` (~0.3 us
against ~1.5 us for ``manual_seed``), where :func:`kernel_agrees` found them equal at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["TorchStates", "kernel_agrees", "take", "torch_states_back"]

_torch_gen = torch.default_generator
_TORCH_STATE_BYTES = int(_torch_gen.get_state().numel())


class TorchStates:
    """Room for the torch states of ``n`` samples: the kernel writes ``arrays``, ``set_state()`` reads ``tensors``.

    Separate tensors, not views of one (``set_state`` reads a tensor's storage from its start).
    """

    __slots__ = ("arrays", "tensors")

    def __init__(self, n: int) -> None:
        self.tensors = [torch.empty(_TORCH_STATE_BYTES, dtype=torch.uint8) for _ in range(n)]
        self.arrays = [t.numpy() for t in self.tensors]


_SPARE: list[TorchStates] = []  # TorchStates given back, for the next batch (one per batch being loaded)


def take(n: int, least: int) -> TorchStates:
    """Room for ``n`` torch states for one batch (at least ``least``): one given back, else a new one."""
    while _SPARE:
        spare = _SPARE.pop()
        if len(spare.tensors) >= n:
            return spare
    return TorchStates(max(n, least))


def torch_states_back(spare: TorchStates) -> None:
    """Give back what :func:`take` gave, once its states are put in place."""
    _SPARE.append(spare)


def kernel_agrees(kernel: Any, seeds: Sequence[int]) -> bool:
    """Whether ``set_state()`` of the ``kernel``'s torch states leaves torch's generator as ``manual_seed`` does.

    Compared as ``get_state()`` and ``initial_seed()`` after each, for the ``seeds`` checked at import (a wide pass
    and one sample alone); torch's generator is put back afterwards.
    """
    if kernel is None:
        return False
    saved = _torch_gen.get_state()
    try:
        room = TorchStates(len(seeds))
        kernel.states(list(seeds), room.arrays)
        for z, state in zip(seeds, room.tensors, strict=True):
            _torch_gen.manual_seed(z)
            expected = _torch_gen.get_state()
            torch.rand(1)  # move it, so that set_state() has something to overwrite
            _torch_gen.set_state(state)
            if not torch.equal(_torch_gen.get_state(), expected) or _torch_gen.initial_seed() != z:
                return False
        return True
    except Exception:  # any surprise (another state format): manual_seed
        return False
    finally:
        _torch_gen.set_state(saved)
