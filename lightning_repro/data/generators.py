"""Generators a dataset holds itself: found once at takeover, re-seeded per sample like the global streams.

A dataset (or a transform object it holds) that keeps its own generator, ``self.rng =
np.random.default_rng(0)``, draws from a stream that no per-sample seeding of the global
streams reaches: its draws depend on how many samples the same copy loaded before, so on
``num_workers``, and a resume diverges. :func:`find_generators` walks the dataset's attributes
(``vars()``), the objects it holds (transforms, ``Compose.transforms`` lists, a wrapped
``.dataset`` such as ``Subset``, ``nn.Module`` children) to a bounded depth, without cycles, and
returns every generator it can re-seed in place (:class:`OwnGenerator`) and the path of every one it
cannot. Each found generator is re-seeded before each sample from ``mix_seed(sample seed, hash of
its path)``, so two generators never share a stream, nor share one with the global streams.

Keyed: ``random.Random`` (and subclasses), ``numpy.random.RandomState``, ``numpy.random.Generator``
and a bare ``numpy.random.BitGenerator`` (PCG64 and PCG64DXSM set directly from mixed 128-bit words,
MT19937 through legacy seeding, others from a fresh one of the same type: correct, slower), and CPU
``torch.Generator``. Not keyed (the caller warns): ``random.SystemRandom`` (it cannot be seeded),
``torch.Generator`` on another device (workers cannot use CUDA), and objects that look like a
generator (``manual_seed``, ``bit_generator``) of a type we do not know, unless a known generator was
found inside them.
"""

from __future__ import annotations

import hashlib
import random
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_repro.seeding import fold_seed32, mix_seed
from lightning_repro.streams import own_generator_seed

__all__ = [
    "OwnGenerator",
    "capture_generators",
    "find_generators",
    "iterator_generators",
    "reseed_generators",
    "restore_generators",
]

_MAX_DEPTH = 6  # attribute / item hops from the dataset
_MAX_ITEMS = 64  # items looked at in one list, tuple or dict (a dataset's list of a million samples is not scanned)
_MAX_NODES = 4096  # objects looked at in all

_SKIP = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    torch.Tensor,
    np.ndarray,
    np.generic,
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    range,
    memoryview,
)


class OwnGenerator(NamedTuple):
    """A generator found in a dataset, with how to re-seed it in place and to save/restore its state."""

    path: str  # from the dataset, e.g. ``transform.transforms[1].rng``
    obj: Any
    salt: int  # 64-bit hash of the path: the generator's stream within a sample's
    reseed: Callable[[Any, int], None]
    capture: Callable[[Any], Any]
    restore: Callable[[Any, Any], None]


# ------------------------------------------------------------------ re-seeding, one function per kind
_py_seed = random.Random.seed
_PCG = (np.random.PCG64, np.random.PCG64DXSM)


def _reseed_bits(bit_generator: Any, seed: int) -> None:
    """Re-seed ``bit_generator`` in place from a 64-bit ``seed``, clearing any buffered value."""
    if type(bit_generator) in _PCG:  # ~1 us: the 128-bit state and an odd increment, from mixed words
        w0, w1, w2, w3 = (mix_seed(seed, k) for k in range(4))
        bit_generator.state = {
            "bit_generator": type(bit_generator).__name__,
            "state": {"state": (w0 << 64) | w1, "inc": (w2 << 64) | w3 | 1},
            "has_uint32": 0,
            "uinteger": 0,
        }
    elif type(bit_generator) is np.random.MT19937:  # ~3 us: legacy seeding, through a RandomState sharing it
        np.random.RandomState(bit_generator).seed(fold_seed32(seed))
    else:  # correct for any bit generator, slower (SeedSequence): ~50 us for Philox
        bit_generator.state = type(bit_generator)(seed).state


def _reseed_random(obj: Any, seed: int) -> None:
    _py_seed(obj, seed)  # clears the cached gaussian too


def _reseed_random_subclass(obj: Any, seed: int) -> None:
    obj.seed(seed)


def _reseed_random_state(obj: Any, seed: int) -> None:
    obj.seed(fold_seed32(seed))  # also clears the cached gaussian


def _reseed_random_state_other(obj: Any, seed: int) -> None:
    # RandomState.seed() re-seeds MT19937 only: re-seed its bit generator, then clear the cached gaussian
    _reseed_bits(obj._bit_generator, seed)
    obj.set_state({**obj.get_state(legacy=False), "has_gauss": 0, "gauss": 0.0})


def _reseed_numpy_generator(obj: Any, seed: int) -> None:
    _reseed_bits(obj.bit_generator, seed)


def _reseed_bit_generator(obj: Any, seed: int) -> None:
    _reseed_bits(obj, seed)


def _reseed_torch(obj: Any, seed: int) -> None:
    obj.manual_seed(seed)


def _get_state(obj: Any) -> Any:
    return obj.get_state()


def _set_state(obj: Any, state: Any) -> None:
    obj.set_state(state)


def _get_random_state(obj: Any) -> Any:
    return obj.get_state(legacy=False)  # a dict for any bit generator, with the cached gaussian


def _get_python(obj: Any) -> Any:
    return obj.getstate()


def _set_python(obj: Any, state: Any) -> None:
    obj.setstate(state)


def _get_bits(obj: Any) -> Any:
    return (obj.bit_generator if isinstance(obj, np.random.Generator) else obj).state


def _set_bits(obj: Any, state: Any) -> None:
    (obj.bit_generator if isinstance(obj, np.random.Generator) else obj).state = state


_Kind = tuple[Callable[[Any, int], None], Callable[[Any], Any], Callable[[Any, Any], None]]


def _classify(obj: Any) -> _Kind | str | None:
    """How to key ``obj``; a reason when it is a generator we cannot key; None when it is not a generator."""
    if isinstance(obj, random.SystemRandom):
        return "random.SystemRandom draws from the operating system and cannot be seeded"
    if isinstance(obj, random.Random):
        reseed = _reseed_random if type(obj) is random.Random else _reseed_random_subclass
        return reseed, _get_python, _set_python
    if isinstance(obj, np.random.RandomState):
        bit_generator = getattr(obj, "_bit_generator", None)
        if type(bit_generator) is np.random.MT19937:
            return _reseed_random_state, _get_random_state, _set_state
        if isinstance(bit_generator, np.random.BitGenerator):
            return _reseed_random_state_other, _get_random_state, _set_state
        return "a numpy RandomState whose bit generator lightning-repro cannot reach"
    if isinstance(obj, np.random.Generator):
        return _reseed_numpy_generator, _get_bits, _set_bits
    if isinstance(obj, np.random.BitGenerator):
        return _reseed_bit_generator, _get_bits, _set_bits
    if isinstance(obj, torch.Generator):
        if obj.device.type != "cpu":
            return (
                f"a torch.Generator on {obj.device} cannot be re-seeded per sample in dataloader workers"
                " (they cannot use the accelerator)"
            )
        return _reseed_torch, _get_state, _set_state
    cls = type(obj)
    if callable(getattr(cls, "manual_seed", None)) or hasattr(cls, "bit_generator") or "bit_generator" in _vars(obj):
        return f"its type {cls.__module__}.{cls.__qualname__} is not a generator lightning-repro knows how to re-seed"
    return None


def _vars(obj: Any) -> dict[str, Any]:
    try:
        attributes = vars(obj)
    except TypeError:  # no __dict__ (slots, builtins)
        return {}
    return attributes if isinstance(attributes, dict) else {}


def _salt(path: str) -> int:
    return int.from_bytes(hashlib.blake2b(b"own-generator:" + path.encode(), digest_size=8).digest(), "little")


def find_generators(dataset: Any) -> tuple[list[OwnGenerator], list[tuple[str, str]]]:
    """The generators ``dataset`` holds, directly or inside the objects it holds (see the module docstring).

    The global generators (``random``'s, numpy's, ``torch.default_generator``) are left out: they are keyed
    per sample already.

    Args:
        dataset: A map-style dataset.

    Returns:
        The generators found that can be keyed, and ``(path, reason)`` for those that cannot.
    """
    found: list[OwnGenerator] = []
    unkeyable: list[tuple[str, str]] = []
    seen = {id(dataset), id(random._inst), id(np.random.mtrand._rand), id(torch.default_generator)}  # type: ignore[attr-defined]
    budget = [_MAX_NODES]

    def visit(obj: Any, path: str, depth: int) -> None:
        if obj is None or isinstance(obj, _SKIP) or id(obj) in seen or budget[0] <= 0:
            return
        seen.add(id(obj))
        budget[0] -= 1
        kind = _classify(obj)
        if kind is not None and not isinstance(kind, str):
            reseed, capture, restore = kind
            found.append(OwnGenerator(path, obj, _salt(path), reseed, capture, restore))
            return
        before = len(found)
        if depth < _MAX_DEPTH:
            children(obj, path, depth + 1)
        if isinstance(kind, str) and len(found) == before:  # generator-like, and nothing keyable inside
            unkeyable.append((path, kind))

    def children(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj[:_MAX_ITEMS]):
                visit(item, f"{path}[{i}]", depth)
        elif isinstance(obj, dict):
            for i, (key, item) in enumerate(obj.items()):
                if i >= _MAX_ITEMS:
                    break
                if path.endswith("._modules") and isinstance(key, str):  # nn.Module children: transform.0.rng
                    visit(item, f"{path[: -len('._modules')]}.{key}", depth)
                else:
                    visit(item, f"{path}[{key!r}]", depth)
        else:
            for name, item in list(_vars(obj).items())[:_MAX_ITEMS]:
                visit(item, f"{path}.{name}" if path else name, depth)

    children(dataset, "", 1)
    return found, unkeyable


def _replays_itself(iterator: Any) -> bool:
    """Whether ``iterator`` is litdata's mix iterator, whose ``random.Random`` picks litdata replays on resume."""
    cls = type(iterator)
    return cls.__module__.split(".", 1)[0] == "litdata" and cls.__name__ == "_CombinedDatasetIterator"


def iterator_generators(iterator: Any, known: list[OwnGenerator]) -> list[OwnGenerator]:
    """The generators an iterable dataset's iterator holds, made by its ``__iter__`` at each pass.

    litdata's ``ParallelStreamingDataset`` gives its transform generators it seeds at every ``__iter__`` from the
    items read so far: a resumed pass gets new ones, so the transform draws other values than in the uninterrupted
    run. Keyed per item like the dataset's own (their path under ``iter()``), they draw the same. ``known`` (found at
    takeover, or the dataset itself when ``__iter__`` returns it) are left out; a python generator holds none, and
    litdata's ``CombinedStreamingDataset`` iterator replays its picks itself.
    """
    if isinstance(iterator, types.GeneratorType) or _replays_itself(iterator):
        return []
    found, _ = find_generators(iterator)
    ids = {id(generator.obj) for generator in known}
    paths = {id(generator.obj): f"iter().{generator.path}" for generator in found}
    return [
        OwnGenerator(paths[id(g.obj)], g.obj, _salt(paths[id(g.obj)]), g.reseed, g.capture, g.restore)
        for g in found
        if id(g.obj) not in ids
    ]


def reseed_generators(generators: list[OwnGenerator], seed: int) -> None:
    """Re-seed each generator in place from ``(seed, its path)``: the sample's (or batch's) stream."""
    for generator in generators:
        generator.reseed(generator.obj, own_generator_seed(seed, generator.salt))


def capture_generators(generators: list[OwnGenerator]) -> list[Any]:
    """The states of ``generators``, to put back with :func:`restore_generators`."""
    return [generator.capture(generator.obj) for generator in generators]


def restore_generators(generators: list[OwnGenerator], states: list[Any]) -> None:
    """Put back the states :func:`capture_generators` returned."""
    for generator, state in zip(generators, states, strict=True):
        generator.restore(generator.obj, state)
