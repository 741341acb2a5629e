"""Where two step traces part, the field that differs first and its likely cause (see :mod:`lightning_repro.trace`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_repro._warn import ranks_text
from lightning_repro.exceptions import InputError
from lightning_repro.trace.records import Trace, TraceRecord, read_trace

__all__ = ["CAUSES", "TraceDiff", "diff_traces", "every_rank_continuation", "explain_cause", "first_difference"]

_FIELD_CAUSES = (
    ("indices", "data-order"),
    ("epoch", "data-order"),
    ("batch", "data-order"),
    ("data", "data-content"),
    ("streams", "rng"),
    ("loss", "numerics"),
    ("params", "parameters"),
)
CAUSES = ("data-order", "data-content", "rng", "numerics", "parameters")
"""The causes :func:`diff_traces` can name, in their order of precedence."""

_EXPLAIN = {
    "data-order": "the steps consumed other samples (the sample indices differ): the data order changed (sampler,"
    " shuffle seed, or the data position of a resume)",
    "data-content": "the same sample indices gave other batch contents: the dataset or its augmentation drew from"
    " an unseeded source, or the data changed",
    "rng": "the process RNG streams (python, numpy, torch, CUDA) differ at the start of the step: something drew"
    " from or re-seeded a global RNG in one run only (a callback, a logger, a library)",
    "numerics": "the samples, the batch and the RNG streams agree but the loss differs: the parameters changed"
    " before this step (they are digested every `trace_params_every` steps: another learning rate or optimizer state"
    " reads as this too), a nondeterministic operation (atomics, a cuDNN algorithm choice), or noise from outside"
    " the seeded streams",
    "parameters": "inputs and loss agree but the parameters after the step differ: nondeterminism in backward or"
    " the optimizer update (parameters are digested every `trace_params_every` steps, so it may be earlier)",
}


# ---------------------------------------------------------------------------------------------- diff
@dataclass(frozen=True)
class TraceDiff:
    """Where two traces of one rank part.

    Attributes:
        first_divergent_step: The first common step whose records differ, or None when all common steps agree.
        last_equal_step: The last common step before it (or the last common step) whose records agree.
        field: The first field that differs at the divergent step (in the order of precedence of the causes).
        cause: ``data-order``, ``data-content``, ``rng``, ``numerics`` or ``parameters``.
        common_steps: How many steps both traces hold.
        rank: The rank compared.
        a: The record of trace A at the divergent step.
        b: The record of trace B at the divergent step.
        only_a: Steps only trace A holds.
        only_b: Steps only trace B holds.
    """

    first_divergent_step: int | None
    last_equal_step: int | None
    field: str | None
    cause: str | None
    common_steps: int
    rank: int = 0
    a: TraceRecord | None = None
    b: TraceRecord | None = None
    only_a: int = 0
    only_b: int = 0

    @property
    def diverged(self) -> bool:
        """The traces differ at a common step."""
        return self.first_divergent_step is not None

    def explanation(self) -> str:
        """The finding in words."""
        if not self.common_steps:
            return "the traces have no step in common: nothing to compare"
        if self.first_divergent_step is None:
            sides = ((self.only_a, "A"), (self.only_b, "B"))
            more = [f"{n} more step{'s' if n != 1 else ''} only in {side}" for n, side in sides if n]
            # a run that stopped early agrees with the complete one where both went: said, not hidden
            return f"all {self.common_steps} common steps agree bitwise" + (f" ({'; '.join(more)})" if more else "")
        equal = f"steps up to {self.last_equal_step} agree" if self.last_equal_step is not None else "no step agrees"
        return (
            f"the traces part at step {self.first_divergent_step} ({equal}): field {self.field!r} differs first,"
            f" likely cause {self.cause}: {_EXPLAIN[self.cause or '']}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object of ``lightning-repro diff``."""
        return {
            "first_divergent_step": self.first_divergent_step,
            "last_equal_step": self.last_equal_step,
            "field": self.field,
            "cause": self.cause,
            "common_steps": self.common_steps,
            "rank": self.rank,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "a": self.a.to_dict() if self.a is not None else None,
            "b": self.b.to_dict() if self.b is not None else None,
            "explanation": self.explanation(),
        }


@dataclass(frozen=True)
class PathsDiff:
    """Two traces (files or directories) compared rank by rank: :func:`diff_trace_paths`.

    Attributes:
        a: Trace A by rank.
        b: Trace B by rank.
        diffs: One :class:`TraceDiff` per rank both hold.
        first: The earliest divergence over the ranks (the first rank's diff when none diverged).
        notes: Torn last lines dropped, ranks only one side holds.
    """

    a: dict[int, Trace]
    b: dict[int, Trace]
    diffs: list[TraceDiff]
    first: TraceDiff
    notes: list[str]

    @property
    def diverged(self) -> bool:
        """Some rank's traces differ at a common step."""
        return any(d.diverged for d in self.diffs)

    def __str__(self) -> str:
        where = f"rank {self.first.rank}: " if len(self.diffs) > 1 else ""
        return where + self.first.explanation()


def diff_trace_paths(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> PathsDiff:
    """Read two traces (a file, or a directory of per-rank files each) and compare them rank by rank.

    Raises:
        InputError: a path is missing or malformed, or the two have no rank in common.
    """
    left, right = read_trace(a), read_trace(b)
    ranks = sorted(left.keys() & right.keys())
    if not ranks:
        raise InputError(f"{a} (ranks {sorted(left)}) and {b} (ranks {sorted(right)}) have no rank in common")
    diffs = [diff_traces(left[rank], right[rank]) for rank in ranks]
    diverged = [d for d in diffs if d.diverged]
    first = min(diverged, key=lambda d: (d.first_divergent_step or 0, d.rank)) if diverged else diffs[0]
    notes = [note for traces in (left, right) for trace in traces.values() for note in trace.notes]
    notes += [f"rank {r} is only in {a if r in left else b}" for r in sorted(left.keys() ^ right.keys())]
    return PathsDiff(left, right, diffs, first, notes + _world_notes(a, left, b, right))


def _world_notes(a: Any, left: dict[int, Trace], b: Any, right: dict[int, Trace]) -> list[str]:
    """What the runs' world sizes (their trace headers) mean for the comparison.

    A single file of a run with several ranks: only that rank was compared. Another world size on each side: each
    rank read other samples, so the steps' data differs from the first step whatever else changed.
    """
    notes, worlds = [], []
    for path, traces in ((a, left), (b, right)):
        sizes = [_world_size(run.header) for trace in traces.values() for run in trace.runs]
        world = max((size for size in sizes if size is not None), default=None)
        worlds.append(world)
        if world is not None and world > 1 and not Path(path).is_dir() and len(traces) < world:
            ranks = ", ".join(map(str, traces))
            notes.append(
                f"{path} is the trace of rank {ranks} of a run with {world} ranks: only that rank is compared"
                " (give the directory holding every rank's trace file to compare them all)"
            )
    if None not in worlds and worlds[0] != worlds[1]:
        notes.append(
            f"the runs had another world size ({worlds[0]} and {worlds[1]} ranks): each rank reads other samples,"
            " so their steps' data differs whatever else changed"
        )
    return notes


def _world_size(header: dict[str, Any]) -> int | None:
    value = header.get("world_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def first_difference(a: TraceRecord, b: TraceRecord) -> tuple[str, str] | None:
    """The first field (in the order of precedence) where two records of one step differ, and its cause.

    A field that either record lacks (None) is not compared.

    Examples:
        >>> a = TraceRecord(4, 0, 3, indices="x", streams="s", loss="1")
        >>> first_difference(a, TraceRecord(4, 0, 3, indices="x", streams="t", loss="2"))
        ('streams', 'rng')
    """
    for name, cause in _FIELD_CAUSES:
        left, right = getattr(a, name), getattr(b, name)
        if left is not None and right is not None and left != right:
            return name, cause
    return None


def diff_traces(a: Trace | Sequence[TraceRecord], b: Trace | Sequence[TraceRecord]) -> TraceDiff:
    """Compare two traces of one rank step by step: the first divergent step, its field and likely cause.

    Examples:
        >>> r = lambda step, **kw: TraceRecord(step, 0, step - 1, indices=str(step), **kw)
        >>> d = diff_traces([r(1, loss="a"), r(2, loss="b")], [r(1, loss="a"), r(2, loss="c")])
        >>> d.first_divergent_step, d.last_equal_step, d.field, d.cause, d.common_steps
        (2, 1, 'loss', 'numerics', 2)
    """
    left = {r.step: r for r in (a.records if isinstance(a, Trace) else a)}
    right = {r.step: r for r in (b.records if isinstance(b, Trace) else b)}
    common = sorted(left.keys() & right.keys())
    rank = a.rank if isinstance(a, Trace) else (left[common[0]].rank if common else 0)
    only_a, only_b = len(left.keys() - right.keys()), len(right.keys() - left.keys())
    last_equal = None
    for step in common:
        found = first_difference(left[step], right[step])
        if found is not None:
            name, cause = found
            return TraceDiff(
                step, last_equal, name, cause, len(common), rank, left[step], right[step], only_a=only_a, only_b=only_b
            )
        last_equal = step
    return TraceDiff(None, last_equal, None, None, len(common), rank, only_a=only_a, only_b=only_b)


def explain_cause(cause: str) -> str:
    """What a cause of :data:`CAUSES` means, in words."""
    return _EXPLAIN[cause]


def every_rank_continuation(outcomes: list[dict[str, Any] | None]) -> tuple[str | None, list[str]]:
    """Rank 0's line for every rank's continuation check under DDP, and the warnings to give of other ranks.

    ``outcomes``: each rank's check, in rank order: ``{"steps": [first, last]}`` (verified), ``{"diverged": what,
    "message": its warning}``, or ``None`` (nothing to check). Returns the line (``None`` when no rank checked) and
    the warning to give of the ranks > 0 that diverged (the first one's, naming the others; rank 0 warned of its own
    when it found it).
    """
    diverged = [(rank, o) for rank, o in enumerate(outcomes) if o and "diverged" in o]
    verified = {rank: o["steps"] for rank, o in enumerate(outcomes) if o and "steps" in o}
    unchecked = [rank for rank, o in enumerate(outcomes) if not o]
    if not diverged and not verified:
        return None, []
    by_range: dict[str, list[int]] = {}
    for rank, (a, b) in verified.items():
        by_range.setdefault(f"{a}..{b}", []).append(rank)
    if len(by_range) == 1:
        steps = f"steps {next(iter(by_range))}"
    else:
        steps = ", ".join(f"{ranks_text(ranks)} steps {span}" for span, ranks in by_range.items())
    nothing = f"; nothing compared on {ranks_text(unchecked)} (no trace past the checkpoint to compare with)"
    nothing = nothing if unchecked else ""
    if diverged:
        agreed = f"; verified on {ranks_text(verified)} ({steps})" if verified else ""
        by_what: dict[str, list[int]] = {}
        for rank, o in diverged:
            by_what.setdefault(str(o["diverged"]), []).append(rank)
        found = "; ".join(f"[{ranks_text(ranks)}] {what}" for what, ranks in by_what.items())
        others = [(rank, str(o["message"])) for rank, o in diverged if rank > 0]
        also = f" (the continuation differs on {ranks_text(r for r, _ in others[1:])} too)" if others[1:] else ""
        warnings = [others[0][1] + also] if others else []  # one warning, not one a rank
        return f"continuation NOT verified on every rank: {found}{agreed}{nothing}", warnings
    if unchecked:
        return f"continuation verified on {ranks_text(verified)} only: {steps} bitwise{nothing}", []
    return f"continuation verified on every rank ({len(outcomes)}): {steps} bitwise", []
