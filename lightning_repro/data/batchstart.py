"""The start of the training batch in flight: what a checkpoint written inside that batch saves to resume before it.

A checkpoint written between a batch's fetch and the end of its training step (``trainer.save_checkpoint`` from
``on_train_batch_start`` or ``training_step``, ``OnExceptionCheckpoint`` after an exception there, a Ctrl-C)
finds the process streams drawn by that batch's hooks and ``training_step``, its ``self.log`` values counted,
while Lightning's restart runs the batch again. :class:`BatchStart` keeps, at the fetch that starts each batch
(``_lightning.inflight.watch_train_fetches``: before the transfer hooks and every ``on_train_batch_start``), the
process streams (python, numpy, torch CPU as :func:`~lightning_repro.data.fastrng.capture_fast` takes them, ~2 us;
every CUDA device's once CUDA runs), the update counts of the model's buffers and torchmetrics metrics, and has the
logged aggregates kept as they were then (copy on write). :meth:`BatchStart.rewind` says, at save time, whether the
checkpoint can resume at the batch's start exactly and what it saves then (:class:`Rewind`).

Exact: the batch's fetch and transfer hooks, ``on_train_batch_start`` (any callback's, the module's, the
strategy's), and ``training_step`` under automatic optimization (before its backward) when no buffer (BatchNorm's
statistics) or metric was updated yet. Not exact, and said why: the backward, the optimizer step and the hooks
around them (gradients or weights changed), manual optimization's ``training_step``, LBFGS (``training_step`` again
after the weights moved), a loader that keeps its own position, a ``training_step`` that fetches from a
``dataloader_iter``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_repro._lightning import inflight as _inflight
from lightning_repro._lightning.results import LoggedAtBatchStart
from lightning_repro.data.fastrng import FastState, capture_fast, restore_fast
from lightning_repro.rng import capture_process_streams

__all__ = ["EXACT_HOOKS", "BatchStart", "Rewind", "resume_in_flight"]

EXACT_HOOKS = ("on_train_batch_start", "training_step")
"""The hooks of a batch in flight a checkpoint can be written in (or raise in) and still resume exactly."""


@dataclass(frozen=True)
class Rewind:
    """What a checkpoint written inside a training batch saves (:meth:`BatchStart.rewind`).

    ``batch``: the batch's index in its epoch when it counts as read (in flight), else ``None`` (written in its
    fetch or transfer hooks, before Lightning counted it read). ``exact``: the checkpoint resumes at the batch's
    start; ``streams``, ``logged`` are then the batch start's process streams and logged aggregates. ``why``: what
    keeps it from being exact.
    """

    batch: int | None
    exact: bool
    why: str = ""
    streams: dict[str, Any] | None = None
    logged: dict[str, tuple[Any, Any, int]] | None = None

    def record(self) -> dict[str, Any] | None:
        """The entry's ``in_flight`` record: the batch, exact or not, and why (``None``: not in flight)."""
        if self.batch is None:
            return None
        return {"batch": self.batch, "exact": self.exact, "why": self.why}


_version = operator.attrgetter("_version")  # a tensor's in-place update count (an int): 8 us for 160 buffers, not 17


class BatchStart:
    """The snapshot taken at each training batch's fetch (see the module); one per callback."""

    def __init__(self) -> None:
        self.marker: tuple[int, int] | None = None  # fetch_marker() at the last snapshot
        self.logged = LoggedAtBatchStart()
        self._fast: FastState | None = None
        self._cuda: list[torch.Tensor] | None = None
        self._buffers: list[torch.Tensor] = []
        self._metrics: list[Any] = []
        self._counts: tuple[int, int] = (0, 0)

    def install(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Callable[[], None]]:
        """Take a snapshot at every fetch of the train loop from now on; returns the undos.

        Call it before a resume restores the logged values (their wrappers go on top of the watch) and before the
        epoch starts; :meth:`forget` once the restore is done.
        """
        from torchmetrics import Metric

        self.forget()
        self._buffers = list(pl_module.buffers())
        self._metrics = [module for module in pl_module.modules() if isinstance(module, Metric)]
        return [self.logged.install(trainer), _inflight.watch_train_fetches(trainer, self.take)]

    def forget(self) -> None:
        """No snapshot holds from here until the next fetch (a resume moved the streams)."""
        self.marker = None
        self._fast = self._cuda = None

    def take(self, ready: int, processed: int) -> None:
        """The snapshot, at a fetch (``_lightning.inflight.watch_train_fetches``): a few microseconds a batch."""
        self.marker = (ready, processed)
        self._fast = capture_fast()
        cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        self._cuda = [g.get_state() for g in torch.cuda.default_generators] if cuda else None
        if self._buffers or self._metrics:
            self._counts = self._read_counts()
        self.logged.batch_start()

    def _read_counts(self) -> tuple[int, int]:
        return sum(map(_version, self._buffers)), sum(int(m.update_count) for m in self._metrics)

    def _streams(self) -> dict[str, Any]:
        """The snapshot's process streams, in the form :func:`~lightning_repro.rng.capture_process_streams` gives."""
        assert self._fast is not None
        live = capture_fast()
        restore_fast(self._fast)
        try:
            streams = capture_process_streams()
        finally:
            restore_fast(live)
        if self._cuda is not None:
            streams["cuda"] = [state.clone() for state in self._cuda]
        return streams

    def rewind(self, trainer: pl.Trainer) -> Rewind | None:
        """What a checkpoint written now must save to resume at the current batch's start; ``None``: not in a batch.

        In a batch's fetch or transfer hooks (a Ctrl-C in a dataset's ``__getitem__``, say) nothing but the process
        streams moved: they are the snapshot's. Once the batch counts as read, the snapshot's streams and logged
        values, when nothing else that a checkpoint holds changed (see the module), else why not.
        """
        ready, processed = _inflight.fetch_marker(trainer)
        batch = _inflight.batch_in_progress(trainer)
        if batch is None:  # from the fetch on, before the batch counts as read, or not in a batch
            started = self.marker == (ready, processed)
            return Rewind(batch=None, exact=True, streams=self._streams()) if started else None
        why = self._why_not(trainer, ready, processed)
        if why:
            return Rewind(batch=batch, exact=False, why=why)
        return Rewind(batch=batch, exact=True, streams=self._streams(), logged=dict(self.logged.before))

    def _why_not(self, trainer: pl.Trainer, ready: int, processed: int) -> str:
        if self.marker != (ready - 1, processed):
            return "no snapshot of the batch's start (a `training_step` that fetches from a `dataloader_iter`)"
        hook = _inflight.hook_in_progress(trainer)
        if hook not in EXACT_HOOKS:
            where = f"in `{hook}`" if hook else "between two of Lightning's hooks"
            return f"{where}, after `training_step`: the backward or the optimizer step may have changed the weights"
        if hook == "training_step" and not trainer.lightning_module.automatic_optimization:
            return "in `training_step` under manual optimization: a `manual_backward` or optimizer step may have run"
        if hook == "training_step" and any(isinstance(o, torch.optim.LBFGS) for o in trainer.optimizers):
            return "in `training_step` under LBFGS, which runs it again after the weights moved"
        counts = self._read_counts() if self._buffers or self._metrics else (0, 0)
        if counts[0] != self._counts[0]:
            return "a buffer of the model (BatchNorm's running statistics, say) was updated in the batch"
        if counts[1] != self._counts[1]:
            return "a torchmetrics metric was updated in the batch (its state cannot be taken back)"
        if _inflight.stateful_train_loaders(trainer):
            return "a train loader keeps its own position (`state_dict()`), which counts the batch as read"
        return ""


def resume_in_flight(in_flight: int | None, entry: Any) -> tuple[bool, str | None]:
    """Whether a checkpoint written inside training batch ``in_flight`` resumes at that batch's start, exactly.

    ``in_flight``: the batch's index in its epoch (``_lightning.loops.batch_in_flight``), None for a checkpoint written
    between batches; ``entry``: our entry in the file, with its ``in_flight`` record. Returns ``(rewound, message)``:
    the message of the ``NotExactWarning`` when the resume is not exact, else None.
    """
    record = entry.get("in_flight") if isinstance(entry, dict) else None
    rewound = in_flight is not None and isinstance(record, dict) and bool(record.get("exact"))
    if in_flight is None or entry is None or rewound:
        return rewound, None
    what = (
        f" ({record.get('why')}): the resume trains that batch again from the state the file holds, which the batch"
        " had already changed,"
        if isinstance(record, dict)
        else " by an earlier lightning-repro, which did not save the batch's start: the resume goes on with the next"
        " batch and that batch is never trained,"
    )
    return False, (
        f"The checkpoint was written in the middle of training batch {in_flight} of its epoch{what} so the resumed run"
        " is not the uninterrupted one. For an exact resume, save from `on_train_batch_end` or later (as"
        " `ModelCheckpoint` does), or in the batch before its backward (`on_train_batch_start`, `training_step`)."
    )
