"""The step trace: one record per optimizer step, its JSON-lines file, and where two traces part and why.

A trace file holds JSON lines of two kinds, appended and flushed one at a time (a killed process keeps every
complete line; :func:`read_trace` drops a torn last line with a note)::

    {"run": {"version": 1, "rank": 0, "resumed_from_step": null, "params_every": 1}}   a run starts
    {"step": 1, "epoch": 0, "batch": 0, "rank": 0, "indices": "...", "data": "...", "loss": "...", ...}

A run that resumes from a checkpoint appends to the same file, after a header with ``"resumed_from_step": k``.
A file of several runs reads as one history (:attr:`Trace.records`): each run's records replace the earlier
runs' records of the steps after its resume point (a run that did not resume replaces them all). The superseded
records are kept in :attr:`Trace.runs`; the continuation check compares a resumed run with them.

:func:`diff_traces` names the first step where two traces differ, the first field that differs there and its
likely cause, in this order of precedence: ``data-order`` (the sample indices), ``data-content`` (same indices,
other batch), ``rng`` (process-stream states at step start), ``numerics`` (every input equal, the loss differs:
a nondeterministic operation, or parameters changed since they were last digested) and ``parameters``.
``lightning-repro diff A B`` prints it (:mod:`lightning_repro.cli.trace`).
The records are written by the :class:`~lightning_repro.DeterminismCallback` (``trace=...``) through
:class:`lightning_repro.trace.tracer.StepTracer`.

The folder owns the step trace: ``records`` (a record, the JSON-lines file, reading a history), ``digest`` (exact
digests of batches, parameters and the process streams), ``tracer`` (the per-step recorder the callback drives, the
continuation check), ``diff`` (where two traces part and why; :func:`diff_trace_paths` compares two runs' files rank
by rank). It may import the bottom layer (``exceptions``, ``seeding``, ``streams``, ``rng``, ``_warn``) and ``data``
(the keyed batch a record describes, and the raw-memory stream layout the digests read); nothing above it.
"""

from __future__ import annotations

from lightning_repro.trace.diff import (
    CAUSES,
    PathsDiff,
    TraceDiff,
    diff_trace_paths,
    diff_traces,
    explain_cause,
    first_difference,
)
from lightning_repro.trace.records import (
    TRACE_VERSION,
    Trace,
    TraceRecord,
    TraceRun,
    TraceWriter,
    decode_loss,
    encode_loss,
    history,
    read_trace,
    read_trace_file,
    trace_file_name,
)

__all__ = [
    "CAUSES",
    "TRACE_VERSION",
    "PathsDiff",
    "Trace",
    "TraceDiff",
    "TraceRecord",
    "TraceRun",
    "TraceWriter",
    "decode_loss",
    "diff_trace_paths",
    "diff_traces",
    "encode_loss",
    "explain_cause",
    "first_difference",
    "history",
    "read_trace",
    "read_trace_file",
    "trace_file_name",
]

