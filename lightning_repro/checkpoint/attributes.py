"""What the epoch-start hooks set on the LightningModule and the user's callbacks: compared on a mid-epoch resume.

A mid-epoch resume skips ``on_train_epoch_start`` (Lightning's loop resumes inside the epoch; its hooks ran in the
interrupted process). What the module's or a user callback's hook set there, and no checkpoint holds, is missing
from the resumed process: an epoch's dropout rate or curriculum level (``self.p = schedule[self.current_epoch]``),
a teacher-forcing ratio, a list the epoch's steps append to. The resumed run then trains with what ``__init__``
left, and is not exact.

:class:`UserAttributes` digests the attributes at the start of each epoch (once the fit loop has set up the epoch's
data, before every callback's and the LightningModule's ``on_train_epoch_start``) and again right before its first
batch is fetched; those that changed in between are what the hooks set, and each save records their digests as they
were after the hooks, beside the restore check's digests (keys ``"attribute <path>"`` and, for the message,
``"attribute value <path>"``). A mid-epoch resume compares them, once Lightning and the user's
``on_load_checkpoint`` have restored what they restore, with the resumed process's, and a ``NotExactWarning`` names
those that differ (the resume line then says ``NOT exact``). A resume at an epoch's end runs the hooks: nothing to
compare.

Looked at: the direct attributes of the LightningModule but what every LightningModule has, of each callback of the
user's own class (not Lightning's, or a subclass of one, whose state Lightning handles), and of each train loader's
map-style dataset (a curriculum callback's ``trainer.train_dataloader.dataset.level = ...``; not an
``IterableDataset``, whose reading moves its attributes and whose position ``data.streaming`` keeps, nor one with
``set_epoch``, whose attributes ``data.mapepoch`` records and gives back); values of plain types only (None, bools,
numbers, strings, bytes, tensors and numpy arrays up to :data:`MAX_BYTES`, and lists, tuples, sets and dicts of
them, up to :data:`MAX_LEAVES` values). Left out: modules, parameters and buffers (in the ``state_dict``), any other
object, floats that read as a Unix time (``time.time()``: a timestamp), and the paths named in
``DeterminismCallback(ignore_attributes=...)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_repro._lightning.inflight import watch_epoch_setup, watch_train_fetches
from lightning_repro.checkpoint.owned import train_loaders, user_callbacks
from lightning_repro.exceptions import NotExactWarning

if TYPE_CHECKING:
    from lightning_repro._warn import WarningCache
    from lightning_repro.checkpoint.entry import Entry
    from lightning_repro.checkpoint.state import ReproState

__all__ = ["DIGEST_KEY", "MAX_LEAVES", "VALUE_KEY", "UserAttributes", "attribute_values", "validate_ignored"]

DIGEST_KEY = "attribute "
"""The prefix of an attribute's digest among the restore check's digests (``restore_sha256``)."""
VALUE_KEY = "attribute value "
"""The prefix of an attribute's short description there (what the warning says it was at the save)."""
MAX_LEAVES = 10_000
"""Values in one attribute (a list: its items) beyond which it is not compared (its digest costs)."""
MAX_BYTES = 1 << 20
"""A tensor or numpy array larger than this is not compared (a dataset's samples, not a value a hook sets)."""

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, np.ndarray, np.generic)
_YEAR = 366 * 24 * 3600.0
_module_keys: frozenset[str] | None = None


def _lightning_keys() -> frozenset[str]:
    """What every LightningModule holds (its own and ``nn.Module``'s attributes), and the saved hyperparameters."""
    global _module_keys
    if _module_keys is None:
        _module_keys = frozenset(vars(pl.LightningModule())) | {"_hparams", "_hparams_initial", "_hparams_name"}
    return _module_keys


def _leaves(value: Any, budget: list[int]) -> bool:
    """Whether ``value`` holds plain values only, within the budget of leaves (decremented)."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size() <= MAX_BYTES
    if isinstance(value, np.ndarray):
        return value.nbytes <= MAX_BYTES
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_leaves(item, budget) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and _leaves(item, budget) for k, item in value.items())
    return False


def _clock_like(value: Any) -> bool:
    """A float within a year of ``time.time()``: a timestamp (an epoch's start time), not training state."""
    return type(value) is float and abs(value - time.time()) < _YEAR


def _canonical(value: Any) -> Any:
    """Sets in a stable order (their iteration order depends on the hash seed); numpy values as tensors."""
    if isinstance(value, (set, frozenset)):
        return ["set", sorted((_canonical(v) for v in value), key=repr)]
    if isinstance(value, (list, tuple)):
        return type(value)(_canonical(v) for v in value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return ["ndarray", value.dtype.str, torch.from_numpy(np.ascontiguousarray(value).copy())]
    if isinstance(value, np.generic):
        return ["numpy", value.dtype.str, value.item()]
    return value


def _owners(trainer: Any, pl_module: Any) -> list[tuple[str, Any, Collection[str]]]:
    owners: list[tuple[str, Any, Collection[str]]] = [("module", pl_module, _lightning_keys())]
    for cb in user_callbacks(trainer):
        if any(c.__module__.startswith("lightning.") for c in type(cb).__mro__ if c is not pl.Callback):
            continue  # one of Lightning's callbacks or a subclass: Lightning's state_dict holds what it needs
        owners.append((f"callback[{getattr(cb, 'state_key', type(cb).__qualname__)}]", cb, ()))
    for index, loader in enumerate(train_loaders(trainer)):
        dataset = getattr(loader, "dataset", None)
        if type(dataset).__module__.startswith("lightning_repro."):  # our wrapper: the user's dataset is inside
            dataset = vars(dataset).get("dataset")
        # not an IterableDataset (reading it moves its attributes; data.streaming keeps its position), nor one
        # with set_epoch (data.mapepoch records its attributes and gives them back)
        if (
            isinstance(dataset, torch.utils.data.Dataset)
            and not isinstance(dataset, torch.utils.data.IterableDataset)
            and not callable(getattr(dataset, "set_epoch", None))
        ):
            owners.append((f"train_dataset[{index}]", dataset, ()))
    return owners


def attribute_values(trainer: Any, pl_module: Any, ignore: Collection[str] = ()) -> dict[str, Any]:
    """The attributes compared on resume, by path (``module.<name>``, ``callback[<state_key>].<name>``)."""
    found: dict[str, Any] = {}
    for prefix, owner, skip in _owners(trainer, pl_module):
        try:
            attributes = vars(owner)
        except TypeError:
            continue
        for name in sorted(attributes.keys() - skip):
            path, value = f"{prefix}.{name}", attributes[name]
            if path in ignore or isinstance(value, torch.nn.Module) or _clock_like(value):
                continue
            if _leaves(value, [MAX_LEAVES]):
                found[path] = value
    return found


def _summary(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, np.ndarray):
        return f"a numpy array of shape {value.shape}"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _digests(values: Mapping[str, Any]) -> dict[str, str]:
    from lightning_repro.checkpoint.verify import digest_value

    return {path: digest_value(_canonical(value)) for path, value in values.items()}


def validate_ignored(ignore: Any) -> frozenset[str]:
    """``DeterminismCallback(ignore_attributes=...)``: attribute paths not compared on resume.

    Raises:
        TypeError: not a list (or another collection) of strings.
    """
    if isinstance(ignore, str) or not isinstance(ignore, Collection) or not all(isinstance(p, str) for p in ignore):
        raise TypeError(
            f"`ignore_attributes` must be a list of attribute paths, got {ignore!r};"
            " e.g. ['module.step_times', 'callback[MyTimer].elapsed'] (the paths a NotExactWarning names)"
        )
    return frozenset(ignore)


class UserAttributes:
    """What the epoch-start hooks set: digested each epoch, recorded at each save, compared on a mid-epoch resume.

    Args:
        ignore: Paths never compared (:func:`validate_ignored`).
    """

    def __init__(self, ignore: Collection[str] = ()) -> None:
        self.ignore = frozenset(ignore)
        self._before: dict[str, str] | None = None  # the digests at the epoch's start, before the hooks after ours
        self._set: dict[str, tuple[str, str]] = {}  # what this epoch's start hooks set: path -> (digest, summary)
        self._epoch: object | None = None  # the epoch whose first fetch is awaited
        self._undo: Callable[[], None] | None = None  # takes our fetch watcher out

    def start(
        self, trainer: Any, pl_module: Any, state: ReproState | None, cache: WarningCache, hooks_run: bool
    ) -> None:
        """``on_train_start``, after the restore: compare what the skipped epoch-start hooks set (a mid-epoch resume).

        ``hooks_run``: the epoch-start hooks run in the resumed process (an epoch-end checkpoint): nothing to compare.
        """
        self._before, self._set, self._epoch = None, {}, None
        self._undo = None  # a new fit: Lightning's fetch hook is the one this fit installed (not ours to put back)
        if state is None or state.remap or hooks_run:
            return
        saved = {path: v for path, v in _recorded(state.restore_sha256).items() if path not in self.ignore}
        self._set = saved  # the resumed epoch's: its hooks do not run again in this process
        if not saved:
            return
        values = attribute_values(trainer, pl_module, self.ignore)
        live = _digests({path: values[path] for path in saved if path in values})
        differing = {
            path: (then, _summary(values[path]) if path in values else "missing")
            for path, (digest, then) in sorted(saved.items())
            if live.get(path) != digest
        }
        _warn(differing, cache)

    def watch(self, trainer: Any, pl_module: Any) -> Callable[[], None]:
        """From ``on_train_start``: the digests at each epoch's start, before any ``on_train_epoch_start`` hook.

        Taken when the fit loop has set up the epoch's data (``_lightning.inflight.watch_epoch_setup``), before the
        hooks of every callback (those before ours in the Trainer's list too) and of the LightningModule; returns
        the undo.
        """

        def before() -> None:
            self._before = _digests(attribute_values(trainer, pl_module, self.ignore))

        return watch_epoch_setup(trainer, before)

    def epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """The callback's ``on_train_epoch_start``: the digests again right before the epoch's first fetch.

        Between :meth:`watch`'s digests and the fetch run the epoch-start hooks, and nothing reads a batch yet.
        """
        if self._before is None:  # not watched (a fit loop without `setup_data`): from our own hook on
            self._before = _digests(attribute_values(trainer, pl_module, self.ignore))
        self._set = {}
        self._unwatch()  # an earlier epoch's watcher that never saw a fetch
        epoch = self._epoch = object()  # a fetcher made before this hook still calls an earlier epoch's `take`

        def take(*_: int) -> None:
            if self._epoch is epoch:
                self._epoch = None
                self._after_hooks(trainer, pl_module)
                self._unwatch()  # the fetcher keeps calling what it was given this epoch: a check then

        self._undo = watch_train_fetches(trainer, take)

    def _unwatch(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def _after_hooks(self, trainer: Any, pl_module: Any) -> None:
        values = attribute_values(trainer, pl_module, self.ignore)
        now = _digests(values)
        before, self._before = self._before or {}, None
        self._set = {path: (d, _summary(values[path])) for path, d in now.items() if before.get(path) != d}

    def add_digests(self, entry: Entry) -> Entry:
        """``entry`` with what this epoch's start hooks set (digests and descriptions) in this rank's part."""
        if not self._set or not entry.ranks:
            return entry
        extra = {}
        for path, (digest, summary) in self._set.items():
            extra[DIGEST_KEY + path], extra[VALUE_KEY + path] = digest, summary
        part = entry.ranks[0]
        return replace(entry, ranks=[replace(part, restore_sha256={**part.restore_sha256, **extra}), *entry.ranks[1:]])


def _recorded(digests: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The attributes a checkpoint recorded: path -> (digest, description at the save)."""
    return {
        key[len(DIGEST_KEY) :]: (value, digests.get(VALUE_KEY + key[len(DIGEST_KEY) :], "?"))
        for key, value in digests.items()
        if key.startswith(DIGEST_KEY) and not key.startswith(VALUE_KEY)
    }


def _warn(differing: Mapping[str, tuple[str, str]], cache: WarningCache) -> None:
    if not differing:
        return
    named = ", ".join(f"`{path}` ({then} after those hooks, {now} now)" for path, (then, now) in differing.items())
    cache.warn(
        "a mid-epoch resume skips on_train_epoch_start, and what it set is in no checkpoint:"
        f" {', '.join(differing)} {'differs' if len(differing) == 1 else 'differ'} from the interrupted run's."
        f" {named}: the resumed epoch trains with these"
        " values and is not exact. Set them again where a resumed epoch runs too (in on_load_checkpoint, or from"
        " `self.current_epoch` where they are used), or save them in on_save_checkpoint and put them back in"
        " on_load_checkpoint (a callback: state_dict and load_state_dict); if training never reads them (a timing),"
        " name them in DeterminismCallback(ignore_attributes=[...]).",
        category=NotExactWarning,
    )
