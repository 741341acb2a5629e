"""Generators the user's LightningModule and callbacks hold: kept in the checkpoint entry, given back on resume.

Lightning's checkpoint holds no generator's state. A module that draws its mixup weights from ``self.rng =
np.random.default_rng(0)``, its noise from ``self.noise = torch.Generator().manual_seed(0)``, or a callback with a
``random.Random`` of its own, starts them again from their construction on resume, and the resumed run draws other
values than the uninterrupted one. At each save :func:`find_owned` looks at the direct attributes of every submodule
of the LightningModule and of every callback but ours (and at the items of a list, tuple or dict held there, up to
:data:`_MAX_ITEMS`), :func:`capture_owned` keeps each generator's state in this rank's part (``generators``, by
path; plain values and tensors, loadable with ``weights_only=True``) and :func:`restore_owned` puts them back
when the resume applies the process state.

Known: ``random.Random`` (not ``SystemRandom``, which has no state), numpy's ``RandomState``, ``Generator`` and bit
generators, ``torch.Generator`` on any device. Left out: the global generators (the process streams), and the
generators of the train and validation loaders and their samplers, whose streams the data takeover derives from the
seed and the epoch. A generator used in ``on_train_batch_start`` itself is kept as it is when the checkpoint is
written, which a checkpoint written inside a batch (rewound to its start) does not take back.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from lightning_repro._lightning.prepared import unwrap

__all__ = [
    "capture_owned",
    "find_owned",
    "give_back",
    "restore_owned",
    "run_loaders",
    "train_loaders",
    "user_callbacks",
]

_MAX_ITEMS = 64  # items looked at in one list, tuple or dict held by a module or callback
_GLOBAL = {id(random._inst), id(np.random.mtrand._rand), id(torch.default_generator)}  # type: ignore[attr-defined]
# isinstance() of torch.Generator runs a Python-level __instancecheck__ (~2 us): torch's is matched by its type
_GENERATORS = (random.Random, np.random.RandomState, np.random.Generator, np.random.BitGenerator)


def _is_generator(value: Any) -> bool:
    return type(value) is torch.Generator or isinstance(value, _GENERATORS)


_MODULE_KEYS = frozenset(vars(torch.nn.Module()))
_ARRAY = "__ndarray__"  # the marker of a numpy array in a saved state (dtype, shape, raw bytes)


def _kind(obj: Any) -> str | None:
    if isinstance(obj, random.SystemRandom):
        return None
    if isinstance(obj, random.Random):
        return "python"
    if isinstance(obj, np.random.RandomState):
        return "randomstate"
    if isinstance(obj, (np.random.Generator, np.random.BitGenerator)):
        return "bits"
    if isinstance(obj, torch.Generator):
        return "torch"
    return None


def _held(owner: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """``(path, generator)`` of the attributes of ``owner`` and of the items of its lists, tuples and dicts.

    One ``isinstance`` per attribute (a model of thousands of modules is scanned at every save); the containers of
    private attributes (``nn.Module``'s hooks and children, among them) are not looked into.
    """
    try:
        attributes = vars(owner)
    except TypeError:  # no __dict__
        return
    for name in sorted(attributes.keys() - _MODULE_KEYS):  # not what every nn.Module has (its hooks, children...)
        value = attributes[name]
        if _is_generator(value):
            yield f"{prefix}.{name}", value
        elif name[:1] != "_" and isinstance(value, (list, tuple)):
            for i, item in enumerate(value[:_MAX_ITEMS]):
                if _is_generator(item):
                    yield f"{prefix}.{name}[{i}]", item
        elif name[:1] != "_" and isinstance(value, dict) and len(value) <= _MAX_ITEMS:
            for key, item in value.items():
                if _is_generator(item):
                    yield f"{prefix}.{name}[{key!r}]", item


def _loader_generators(loaders: Iterable[Any]) -> set[int]:
    found = set()
    for loader in loaders:
        batch_sampler = getattr(loader, "batch_sampler", None)
        for obj in (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
            for name in ("generator", "loader_generator"):
                value = getattr(obj, name, None)
                if isinstance(value, torch.Generator):
                    found.add(id(value))
    return found


def user_callbacks(trainer: Any) -> list[Any]:
    """The trainer's callbacks but lightning-repro's own (and their subclasses)."""
    return [
        cb
        for cb in getattr(trainer, "callbacks", [])
        if not any(c.__module__.startswith("lightning_repro.") for c in type(cb).__mro__)
    ]


def train_loaders(trainer: Any) -> list[Any]:
    """The train loaders the trainer holds now (a list or dict of them flattened)."""
    return run_loaders(trainer, ("train_dataloader",))


def run_loaders(trainer: Any, attributes: tuple[str, ...] = ("train_dataloader", "val_dataloaders")) -> list[Any]:
    """The train and validation loaders the trainer holds now (a list or dict of them flattened)."""
    loaders: list[Any] = []
    for attribute in attributes:
        try:
            held = getattr(trainer, attribute, None)
        except Exception:  # a property that needs a state the trainer is not in
            held = None
        if isinstance(held, dict):
            loaders += list(held.values())
        elif isinstance(held, (list, tuple)):
            loaders += list(held)
        elif held is not None:
            loaders.append(held)
    return [unwrap(loader) for loader in loaders]  # a webdataset WebLoader we prepared: its loader


def find_owned(pl_module: Any, callbacks: Iterable[Any], loaders: Iterable[Any] = ()) -> dict[str, Any]:
    """The generators the module's submodules and the callbacks hold, by path; each object once, at its first path.

    Paths: ``module.<submodule name>.<attribute>``, ``callback[<state_key>].<attribute>``, with ``[i]`` or ``[key]``
    for an item of a list, tuple or dict.

    Args:
        pl_module: The LightningModule.
        callbacks: The callbacks to look at (:func:`user_callbacks`).
        loaders: The train and validation loaders: their generators and their samplers' are left out.
    """
    seen = _GLOBAL | _loader_generators(loaders)
    found: dict[str, Any] = {}
    owners: list[tuple[str, Any]] = [
        (f"module.{name}" if name else "module", module) for name, module in pl_module.named_modules()
    ]
    owners += [(f"callback[{getattr(cb, 'state_key', type(cb).__qualname__)}]", cb) for cb in callbacks]
    for prefix, owner in owners:
        for path, value in _held(owner, prefix):
            if id(value) not in seen and _kind(value) is not None:
                seen.add(id(value))
                found[path] = value
    return found


def _plain(value: Any) -> Any:
    """A generator state as values ``torch.load(weights_only=True)`` reads: numpy arrays as dtype, shape, bytes."""
    if isinstance(value, np.ndarray):
        raw = torch.frombuffer(bytearray(np.ascontiguousarray(value).tobytes()), dtype=torch.uint8)
        return {_ARRAY: value.dtype.str, "shape": list(value.shape), "bytes": raw}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_plain(value: Any) -> Any:
    if isinstance(value, dict) and _ARRAY in value:
        array = np.frombuffer(value["bytes"].numpy().tobytes(), dtype=np.dtype(value[_ARRAY]))
        return array.reshape(value["shape"]).copy()
    if isinstance(value, dict):
        return {key: _from_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_from_plain(item) for item in value)
    return value


def _state(obj: Any) -> dict[str, Any]:
    kind = _kind(obj)
    if kind == "python":
        version, internal, gauss = obj.getstate()
        return {"kind": kind, "version": version, "words": list(internal), "gauss": gauss}
    if kind == "randomstate":
        return {"kind": kind, "state": _plain(obj.get_state(legacy=False))}
    if kind == "bits":
        bits = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
        return {"kind": kind, "state": _plain(bits.state)}
    return {"kind": "torch", "state": obj.get_state().clone()}


def capture_owned(found: dict[str, Any]) -> dict[str, Any]:
    """The state of every generator :func:`find_owned` found, by path."""
    return {path: _state(obj) for path, obj in found.items()}


def restore_owned(found: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """Put the saved states back into the generators found now, path by path; what could not be put back.

    Returns:
        For each saved generator not put back, why: no generator at its path now, one of another kind, or one whose
        state the saved one is not (a ``torch.Generator`` on another device, a bit generator of another type); the
        caller warns.
    """
    lost = []
    for path, state in saved.items():
        obj = found.get(path)
        if obj is None:
            lost.append(path)
        elif _kind(obj) != state.get("kind"):
            lost.append(
                f"{path} is a {type(obj).__qualname__} now, the checkpoint saved a {state.get('kind')} generator"
            )
        else:
            try:
                _put(obj, state)
            except (TypeError, ValueError, RuntimeError) as error:
                lost.append(f"{path}: {error}")
    return lost


def _put(obj: Any, state: dict[str, Any]) -> None:
    kind = state["kind"]
    if kind == "python":
        obj.setstate((state["version"], tuple(state["words"]), state["gauss"]))
    elif kind == "randomstate":
        obj.set_state(_from_plain(state["state"]))
    elif kind == "bits":
        bits = obj.bit_generator if isinstance(obj, np.random.Generator) else obj
        bits.state = _from_plain(state["state"])
    else:
        obj.set_state(state["state"].to(torch.uint8))


def give_back(saved: dict[str, Any], trainer: Any) -> str | None:
    """Restore the generators of ``trainer``'s module and the user's callbacks from ``saved``; what was lost, if any.

    Returns:
        The message of a ``NotExactWarning`` when a saved generator is not held at its path now (or holds another
        kind of generator), else None.
    """
    found = find_owned(trainer.lightning_module, user_callbacks(trainer), run_loaders(trainer))
    missing = restore_owned(found, saved)
    if not missing:
        return None
    return (
        "The checkpoint holds the state of generators that this run's module or callbacks do not hold"
        f" ({'; '.join(missing)}): their draws after the resume are not the interrupted run's."
    )
