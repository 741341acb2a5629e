"""Recording the step trace during ``fit``, and the continuation check of a resumed run.

:class:`StepTracer` is owned by :class:`~lightning_repro.DeterminismCallback` (``trace=...``); the callback's
hooks call it. The record format, the file and the diff are in :mod:`lightning_repro.trace`.

Digests are exact (:mod:`lightning_repro.trace.digest`): SHA-256 of raw bytes on the CPU, integer sums of bit
patterns on an accelerator, fetched once per record.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_prefixed_message

from lightning_repro._warn import WarningCache, from_every_rank, say, warn
from lightning_repro.data.keyed import KeyedBatch, SampleKey
from lightning_repro.exceptions import DivergenceError, InputError, NotExactWarning, ReproWarning
from lightning_repro.trace.diff import every_rank_continuation, explain_cause, first_difference
from lightning_repro.trace.digest import DIGEST_HEX, Digest, digest_streams, to_host
from lightning_repro.trace.records import TraceRecord, TraceWriter, encode_loss, read_trace_file, trace_file_name

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_repro.checkpoint.entry import Entry

__all__ = [
    "TAIL_RECORDS",
    "StepTracer",
    "attach_trace_tail",
    "validate_trace_options",
]

log = logging.getLogger(__name__)

TAIL_RECORDS = 16
"""How many of the last records go into the checkpoint entry (this rank's part, ``"trace"``)."""
_SAMPLER_MEMORY = 1024  # batches yielded, not yet consumed, a train sampler remembers (its lead is the prefetch)


def validate_trace_options(trace: Any, params_every: Any, on_divergence: Any) -> None:
    """Check ``DeterminismCallback``'s ``trace``, ``trace_params_every`` and ``on_divergence``.

    ``trace_params_every`` given while the trace is off (``trace`` None or False) has no effect: a ``ReproWarning``
    says so (a configuration may switch the trace off and keep the other option).

    Raises:
        TypeError: ``trace`` is not a bool, a path or None; ``trace_params_every`` is not an int or None.
        ValueError: ``trace`` is an empty path; ``trace_params_every`` is below 1; ``on_divergence`` is not "warn" or
            "error".
    """
    if on_divergence not in ("warn", "error"):
        raise ValueError(
            f"`on_divergence` must be 'warn' or 'error', got {on_divergence!r}; 'error' raises on the first"
            " divergence found, 'warn' warns and training goes on"
        )
    if trace is not None and not isinstance(trace, (bool, str, os.PathLike)):
        raise TypeError(f"`trace` must be True, a path or None, got {trace!r}; pass e.g. trace='runs/trace.jsonl'")
    if isinstance(trace, (str, os.PathLike)) and not os.fspath(trace).strip():
        raise ValueError(f"`trace` is an empty path ({trace!r}); pass True (beside the checkpoints) or a path")
    if params_every is None:
        return
    if isinstance(params_every, bool) or not isinstance(params_every, int) or params_every < 1:
        error = ValueError if isinstance(params_every, int) and not isinstance(params_every, bool) else TypeError
        raise error(
            f"`trace_params_every` must be an int >= 1 or None (the default), got {params_every!r};"
            " the parameters are digested every that many optimizer steps"
        )
    if not trace:
        warn(
            f"`trace_params_every={params_every}` has no effect: the step trace is off (trace={trace!r});"
            " pass trace=True or a path to write it",
            ReproWarning,
        )


# ---------------------------------------------------------------------------------------------- exact digests
def _indices_of(batch: Any) -> list[Any]:
    if isinstance(batch, KeyedBatch):
        return list(batch.indices)
    if isinstance(batch, SampleKey):
        return [batch.index]
    if isinstance(batch, torch.Tensor):
        return list(batch.tolist()) if batch.dim() else [batch.item()]
    return list(batch) if isinstance(batch, (list, tuple)) else [batch]


def _loss_of(outputs: Any) -> float | torch.Tensor | None:
    """The step's loss: a float (exact: widened to binary64) on the CPU; on a device, its int64 bits, kept there."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        if loss.is_cpu:
            return float(loss.item())  # one torch call: each costs some 10 us right after a step (cold caches)
        return loss.detach().reshape(()).to(torch.float64).view(torch.int64)
    return None


@dataclass
class _Window:
    """The batches of one optimizer step so far (several under gradient accumulation)."""

    step_before: int
    streams: str
    indices: list[Any] = field(default_factory=list)
    data: Digest = field(default_factory=Digest)
    losses: list[float | torch.Tensor | None] = field(default_factory=list)
    batch: int = 0


# ---------------------------------------------------------------------------------------------- the tracer
class StepTracer:
    """Writes one :class:`~lightning_repro.trace.TraceRecord` per optimizer step, and checks a resumed run.

    Args:
        target: ``True`` (a file beside the checkpoints) or a path (see
            :func:`~lightning_repro.trace.trace_file_name`).
        params_every: Digest the parameters every that many optimizer steps.
        on_divergence: ``"error"`` raises :class:`~lightning_repro.DivergenceError` at the first step where a
            resumed run differs from the interrupted run's trace; ``"warn"`` warns.
        warnings: The callback's warning cache (each warning once).
    """

    def __init__(
        self, target: bool | str | os.PathLike[str], *, params_every: int, on_divergence: str, warnings: WarningCache
    ) -> None:
        self.target = target
        self.params_every = params_every
        self.on_divergence = on_divergence
        self._warnings = warnings
        self.path: Path | None = None
        self._writer: TraceWriter | None = None
        self._window: _Window | None = None
        self._tail: deque[TraceRecord] = deque(maxlen=TAIL_RECORDS)
        self._rank, self._world = 0, 1
        self._expected: dict[int, TraceRecord] = {}  # the interrupted run's records after the checkpoint
        self._verified: list[int] = []
        self.continuation: str | None = None  # "verified", "diverged" or None (nothing to check)
        self._outcome: dict[str, Any] | None = None  # this rank's check, for the line of every rank (say_every_rank)
        self.restore_failed: str | None = None  # what the restore check found differ, when it did (the callback's)

    # ------------------------------------------------------------------ where the file goes
    def resolve_path(self, trainer: pl.Trainer) -> Path:
        """This rank's trace file.

        ``trace=True`` puts ``trace-rank{r}.jsonl`` in the directory of the checkpoint being resumed (so a resumed
        run appends to the interrupted run's trace; a distributed checkpoint, itself a directory, counts as a file
        there), else in the ``ModelCheckpoint``'s ``dirpath``, else in the trainer's ``default_root_dir``.
        """
        rank, world = trainer.global_rank, trainer.world_size
        if self.target is not True:
            return trace_file_name(self.target, rank, world)  # type: ignore[arg-type]
        resumed = getattr(trainer, "ckpt_path", None)
        checkpoint = trainer.checkpoint_callback
        dirpath = getattr(checkpoint, "dirpath", None) if checkpoint is not None else None
        if resumed and os.path.exists(resumed):  # a file, or a sharded run's checkpoint directory
            directory = Path(resumed).parent
        elif dirpath:
            directory = Path(dirpath)
        else:
            directory = Path(trainer.default_root_dir)
        return directory / f"trace-rank{rank}.jsonl"

    # ------------------------------------------------------------------ lifecycle
    def watch(self, sampler: Any) -> None:
        """Make a train ``ReproBatchSampler`` remember the indices of the batches it yields (a bounded record)."""
        if getattr(sampler, "trace_batches", None) is None:
            sampler.trace_batches = deque(maxlen=_SAMPLER_MEMORY)

    def start(
        self, trainer: pl.Trainer, *, resumed: bool, check: bool = True, tail: list[dict[str, Any]] | None = None
    ) -> None:
        """Open this rank's file; after a resume (and with ``check``), load the interrupted run's records to check.

        Args:
            trainer: The trainer, its state restored.
            resumed: The run resumed from a checkpoint (at ``trainer.global_step``).
            check: Compare the resumed steps with the interrupted run's records past the checkpoint.
            tail: The trace records the checkpoint holds (the last before its step).
        """
        self.close()
        self._rank, self._world = trainer.global_rank, int(trainer.world_size)
        self._window = None
        self._tail.clear()
        self._expected, self._verified, self.continuation, self._outcome = {}, [], None, None
        self.restore_failed = None
        self.path = self.resolve_path(trainer)
        step = trainer.global_step
        if resumed and check and self.path.exists():
            self._expected = self._interrupted_records(self.path, step, tail)
        for record in tail or []:
            self._tail.append(TraceRecord.from_dict(record))
        self._writer = TraceWriter(self.path)
        if self._writer.cut:
            self._info(f"cut a torn last line ({self._writer.cut} bytes) off the trace {self.path}")
        self._writer.header(
            rank=self._rank,
            world_size=int(trainer.world_size),
            resumed_from_step=step if resumed else None,
            params_every=self.params_every,
        )

    def _interrupted_records(self, path: Path, step: int, tail: list[dict[str, Any]] | None) -> dict[int, TraceRecord]:
        try:
            trace = read_trace_file(path)
        except InputError as error:
            self._warn(f"The trace file cannot be read, so the resumed run is not checked against it: {error}")
            return {}
        records = trace.by_step()
        if tail:
            last = TraceRecord.from_dict(tail[-1])
            if last.step in records and first_difference(records[last.step], last) is not None:
                self._warn(
                    f"The trace {path} does not hold the run the checkpoint was written by (its step {last.step}"
                    " differs from the checkpoint's): the resumed run is not checked against it."
                )
                return {}
        return {s: r for s, r in records.items() if s > step}

    def batch_start(self, trainer: pl.Trainer, batch: Any, batch_idx: int, samplers: Mapping[int, Any]) -> None:
        """``on_train_batch_start``: the stream digest at a step's start, the batch's indices and contents."""
        window = self._window
        if window is None:
            window = self._window = _Window(step_before=trainer.global_step, streams=digest_streams())
        window.batch = batch_idx
        window.indices.append([self._indices(sampler) for _, sampler in sorted(samplers.items())])
        window.data.add(batch)

    @staticmethod
    def _indices(sampler: Any) -> list[Any] | None:
        """The indices of the sampler's oldest batch not yet consumed: the loader keeps the sampler's order."""
        record = getattr(sampler, "trace_batches", None)
        if not record:
            return None
        *_, batch = record.popleft()
        return _indices_of(batch)

    def batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """``on_train_batch_end``: the loss; after an optimizer step, the record (written, checked, kept)."""
        window = self._window
        if window is None:
            return
        window.losses.append(_loss_of(outputs))
        step = trainer.global_step
        if step == window.step_before:
            return  # inside an accumulation window (or a batch that did not step)
        self._window = None
        params = Digest() if self.params_every and step % self.params_every == 0 else None
        if params is not None:
            params.add(dict(pl_module.named_parameters()))
        losses = [loss for loss in window.losses if isinstance(loss, torch.Tensor)]
        host = to_host([*window.data.device, *(params.device if params else []), *losses])
        data_host = host[: len(window.data.device)]
        params_host = host[len(window.data.device) : len(host) - len(losses)]
        device_bits = iter(host[len(host) - len(losses) :])
        bits = [
            encode_loss(loss) if isinstance(loss, float) else struct.pack(">q", int(next(device_bits))).hex()
            for loss in window.losses
            if loss is not None
        ]
        record = TraceRecord(
            step=step,
            epoch=trainer.current_epoch,
            batch=window.batch,
            rank=self._rank,
            indices=self._indices_known(window.indices),
            data=window.data.hexdigest(data_host),
            loss=",".join(bits) or None,
            streams=window.streams,
            params=params.hexdigest(params_host) if params is not None else None,
        )
        if self._writer is not None:
            self._writer.write(record)
        self._tail.append(record)
        self._check(record)

    @staticmethod
    def _indices_known(indices: list[Any]) -> str | None:
        if all(part is None for batch in indices for part in batch):
            return None
        return hashlib.sha256(repr(indices).encode()).hexdigest()[:DIGEST_HEX]

    def tail(self) -> list[dict[str, Any]]:
        """The last :data:`TAIL_RECORDS` records as plain dicts (for the checkpoint entry)."""
        return [record.to_dict() for record in self._tail]

    # ------------------------------------------------------------------ the continuation check
    def _check(self, record: TraceRecord) -> None:
        expected = self._expected.get(record.step)
        if expected is None:
            return
        found = first_difference(expected, record)
        if found is None:
            self._verified.append(record.step)
            if record.step >= max(self._expected):
                self._report_verified()
            return
        name, cause = found
        self._expected, self.continuation = {}, "diverged"
        verified = self._verified
        agreed = f"steps {verified[0]}..{verified[-1]} agree" if verified else "no resumed step agrees"
        why = f"likely cause {cause}: {explain_cause(cause)}"
        if self.restore_failed:  # the resume did not restore what the checkpoint saved: that, not the step, parted
            why = f"likely cause: the restore ({self.restore_failed}; the trace alone reads it as {cause})"
        message = rank_prefixed_message(
            f"continuation check: the resumed run differs from the interrupted run's trace ({self.path}) at step"
            f" {record.step} ({agreed}): field {name!r} differs first, {why}",
            self._rank,
        )
        if self.on_divergence == "error":
            raise DivergenceError(message)
        said = f"step {record.step} differs from the trace {self.path} in {name!r} ({cause})"
        self._outcome = {"diverged": said, "message": message}
        say(f"continuation NOT verified{self._on_rank()}: {said}")
        self._warn(message)

    def _report_verified(self) -> None:
        steps, self._expected = self._verified, {}
        if steps:
            self.continuation = "verified"
            self._outcome = {"steps": [steps[0], steps[-1]]}
            self._info(f"continuation verified: steps {steps[0]}..{steps[-1]} bitwise")
            said = f"steps {steps[0]}..{steps[-1]} bitwise against the trace {self.path}"
            say(f"continuation verified{self._on_rank()}: {said}")

    def _on_rank(self) -> str:
        """Under DDP a rank's own check (rank 0's is said; every rank's at the end of the fit: ``say_every_rank``)."""
        return f" on rank {self._rank}" if self._world > 1 else ""

    def finish(self) -> None:
        """At the end of ``fit``: report a partly checked overlap, and close the file."""
        if self._expected:
            self._report_verified()
        self.close()

    def say_every_rank(self) -> None:
        """At the end of a resumed fit under DDP: every rank's continuation check in one line of rank 0's.

        A collective (:func:`~lightning_repro._warn.from_every_rank`): every rank calls it, at ``on_train_end``. Rank
        0 said its own check when it ended; another rank's divergence was a warning in that rank's log only, and the
        data or optimizer state of one rank can differ while rank 0's steps agree.
        """
        gathered = from_every_rank(self._outcome, self._world)
        if gathered is not None and self._rank == 0:
            line, warnings = every_rank_continuation(gathered)
            for message in warnings:
                self._warnings.warn(message, category=NotExactWarning)
            if line:
                say(line)

    def close(self) -> None:
        """Close the file (also after an exception)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def to_check(self) -> str | None:
        """What the continuation check will compare, for the resume line; ``None`` when there is nothing."""
        if not self._expected:
            return None
        return f"continuation check: steps {min(self._expected)}..{max(self._expected)} of the trace {self.path}"

    def _info(self, message: str) -> None:
        log.info(rank_prefixed_message(message, self._rank))

    def _warn(self, message: str) -> None:
        self._warnings.warn(message, category=NotExactWarning)
        if self._rank > 0:  # warnings (and the continuation line) speak on rank 0 only: this rank's, in its log
            log.warning(message)


def attach_trace_tail(entry: Entry, tail: list[dict[str, Any]]) -> Entry:
    """``entry`` with this rank's trace tail in its part (``ranks[0].trace``); ``entry`` itself is left as it is."""
    if not entry.ranks:
        return entry
    return replace(entry, ranks=[replace(entry.ranks[0], trace=tail), *entry.ranks[1:]])
