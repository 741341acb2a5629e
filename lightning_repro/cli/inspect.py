"""``lightning-repro inspect CKPT [--json]``: what a checkpoint's lightning-repro entry holds, and whether it is whole.

For a user asking why a resume says what it says: where the checkpoint was written (step, epoch, batch, inside a
training batch or at its end, what was still due), the seed and topology it resumes under, per rank the data
position of each train loader, what the restore check will compare, the values the epoch-start hooks had set, the
generators and gradients the entry carries, the step trace's tail, and the run manifest's code and packages. The
entry is read as a resume reads it (:meth:`~lightning_repro.checkpoint.entry.Entry.from_dict`): its seal and every
part are checked; nothing is applied and nothing is written.

Exit codes: 0 the entry is whole; 1 it is damaged (its seal or a part does not check, or a distributed checkpoint
directory lacks a tensor file or has one cut short: the message names it);
2 bad input (no such file, not a checkpoint, no lightning-repro entry, an entry newer than this version reads).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_repro.exceptions import CheckpointReadError, CorruptStateError, InputError, ReproError

if TYPE_CHECKING:
    from rich.console import Console

    from lightning_repro.checkpoint.entry import Entry

__all__ = ["inspect_command", "load_entry", "summarize"]

_ATTRIBUTE = "attribute "
_ATTRIBUTE_VALUE = "attribute value "


def load_entry(path: str | Path) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The checkpoint (a file, or a distributed checkpoint directory's ``meta.pt``), its entry's state key, the entry.

    Raises:
        InputError: no such path, not a checkpoint, or no lightning-repro entry in it.
    """
    from lightning_repro.checkpoint.reading import entries_in, load_for_reading

    checkpoint = load_for_reading(path)
    entries = entries_in(checkpoint)
    if not entries:
        if "state_dict" in checkpoint and "callbacks" not in checkpoint and "optimizer_states" not in checkpoint:
            raise InputError(  # what Lightning writes for ModelCheckpoint(save_weights_only=True)
                f"the checkpoint {str(path)!r} holds the weights only (ModelCheckpoint(save_weights_only=True)): no"
                " callback states, so no lightning-repro entry; a run resumes from a full checkpoint"
            )
        raise InputError(
            f"the checkpoint {str(path)!r} holds no lightning-repro entry (written without DeterminismCallback?)"
        )
    return checkpoint, *entries[0]


def _loader(position: dict[str, Any]) -> str:
    epoch, offset, length = position.get("epoch"), position.get("offset"), position.get("length")
    text = f"loader {position.get('index')}: epoch {epoch}, pass {position.get('pass')}, {offset} of {length} batches"
    return text + " read"


def _same(a: Any, b: Any) -> bool:
    """Two CPU tensors bit for bit alike (dtype, shape, bytes: a NaN equals itself, bfloat16 has no numpy dtype)."""
    import torch

    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return bool(a.dtype == b.dtype and a.shape == b.shape and torch.equal(*raw))


def _differ(mine: dict[str, Any], theirs: dict[str, Any]) -> set[str]:
    """The names whose tensor in ``mine`` is not bit for bit the one in ``theirs`` (or is not there)."""
    return {name for name, value in mine.items() if name not in theirs or not _same(value, theirs[name])}


def _own_logged(part: Any, entry: Entry) -> list[str]:
    """The logged values (trainer metric dicts, the pending log row) a rank > 0 keeps unlike rank 0's, by name."""
    names: set[str] = set()
    for kind, values in (part.callback_metrics or {}).items():
        names |= _differ(values, entry.callback_metrics.get(kind) or {})
    if part.pending_log is not None:
        names |= _differ(part.pending_log, (entry.pending or {}).get("log") or {})
    return sorted(names)


def _rank(part: Any, rank: int, entry: Entry) -> dict[str, Any]:
    digests = dict(part.restore_sha256)
    attributes = {k[len(_ATTRIBUTE_VALUE) :]: v for k, v in digests.items() if k.startswith(_ATTRIBUTE_VALUE)}
    checked = sorted(k for k in digests if not k.startswith(_ATTRIBUTE))
    trace = part.trace or []
    return {
        "rank": rank,
        "batches_read": part.batches,
        "loaders": [_loader(p) for p in part.data if isinstance(p, dict)],
        "process_streams_sha256": part.streams_sha256,
        "restore_check": checked,
        "epoch_start_attributes": attributes,
        "generators": sorted(part.generators),
        "gradients_carried": sorted(part.grads or {}),
        "own_buffers": sorted((part.replica or {}).get("buffers") or {}),  # unlike those the file's state holds
        "own_callback_states": sorted((part.replica or {}).get("callbacks") or {}),
        "own_logged_values": _own_logged(part, entry),  # logged without sync_dist: unlike rank 0's
        "streaming_loaders": sorted(part.streaming),
        "loaders_run_out": _run_out(part.ran_out),
        "batch_end": _batch_end(part.batch_end),
        "trace_tail_steps": [trace[0].get("step"), trace[-1].get("step")] if trace else None,
    }


def _run_out(mask: int | None) -> list[int] | None:
    """The train loaders cycled in the epoch (``max_size_cycle``) that ran out, by index; None: not such an epoch."""
    return None if mask is None else [i for i in range(mask.bit_length()) if mask >> i & 1]


def _batch_end(kept: dict[str, Any] | None) -> str | None:
    """What the rest of ``on_train_batch_end`` gets on resume from this part: its outputs, its batch, or why not."""
    if kept is None:
        return None
    outputs = "outputs" if "outputs" in kept else f"no outputs ({kept.get('unstorable')})"
    if "batch" in kept:
        return f"{outputs}, the batch kept"
    why = kept.get("batch_unstorable")
    return f"{outputs}, the batch not kept ({why})" if why else f"{outputs}, the batch loaded again"


def summarize(checkpoint: dict[str, Any], state_key: str, entry: Entry, *, sealed: bool) -> dict[str, Any]:
    """What :func:`inspect_command` prints, as plain values (also its ``--json``)."""
    manifest = entry.manifest or {}
    code, packages = manifest.get("code") or {}, manifest.get("environment") or {}
    in_flight = entry.in_flight or {}
    return {
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
        "lightning": checkpoint.get("pytorch-lightning_version"),
        "state_key": state_key,
        "entry_version": entry.version,
        "sealed": sealed,
        "seed": entry.seed,
        "topology": dict(entry.topology),
        "written": f"inside training batch {in_flight.get('batch')} of its epoch" if in_flight else "between batches",
        "in_flight_exact": in_flight.get("exact") if in_flight else None,
        "in_flight_why": in_flight.get("why") or None,
        "still_due": sorted(k for k, v in (entry.pending or {}).items() if v),
        "hooks_to_finish": (entry.remainder or {}).get("hook"),
        "accumulate_grad_batches": entry.loops.get("accumulate_grad_batches"),
        "frozen_parameters": len(entry.frozen or []),
        "pruned_tensors": [f"{r['module']}.{r['name']}" for r in entry.pruned or []],
        "manifest": {
            "git_commit": code.get("git_commit"),
            "dirty": code.get("dirty"),
            "files_sha256": code.get("files_sha256"),
            **{name: packages.get(name) for name in ("python", "torch", "lightning", "numpy", "lightning_repro")},
        }
        if manifest
        else None,
        "ranks": [_rank(part, rank, entry) for rank, part in enumerate(entry.ranks)],
    }


def _print(path: str, report: dict[str, Any], console: Console) -> None:
    def line(text: str) -> None:
        console.print(text, markup=False, highlight=False)

    topology = report["topology"]
    line(f"{path}: epoch {report['epoch']}, global step {report['global_step']} (Lightning {report['lightning']})")
    line(
        f"lightning-repro entry {report['state_key']!r}, version {report['entry_version']}:"
        f" {'sealed, every part checks' if report['sealed'] else 'whole (an older entry: no seal)'}"
    )
    line("  (the entry only: the weights, optimizer and scheduler states are checked against it by the resume)")
    workers = topology.get("num_workers")
    line(
        f"seed {report['seed']}; world size {topology.get('world_size', 1)} ({topology.get('num_nodes', 1)} node(s))"
        + (f", train loader workers {workers}" if workers else "")
    )
    written = report["written"]
    if report["in_flight_exact"] is not None:
        exact = "resumes at that batch's start" if report["in_flight_exact"] else "does not resume exactly"
        written += f" ({exact}{': ' + report['in_flight_why'] if report['in_flight_why'] else ''})"
    due = f"; still due on resume: {', '.join(report['still_due'])}" if report["still_due"] else ""
    finish = f"; the rest of {report['hooks_to_finish']} runs on resume" if report["hooks_to_finish"] else ""
    line(f"written {written}{due}{finish}")
    if report["accumulate_grad_batches"] is not None:
        line(f"accumulate_grad_batches {report['accumulate_grad_batches']}")
    if report["frozen_parameters"]:
        line(f"{report['frozen_parameters']} parameter(s) frozen (requires_grad=False), given back on resume")
    if report["pruned_tensors"]:
        pruned = report["pruned_tensors"]
        line(f"{len(pruned)} tensor(s) pruned by ModelPruning, pruned again on resume: {', '.join(pruned[:5])}")
    for rank in report["ranks"]:
        line(f"rank {rank['rank']}: {rank['batches_read']} batch(es) of the epoch read")
        for loader in rank["loaders"]:
            line(f"  {loader}")
        if rank["streaming_loaders"]:
            line(f"  streaming positions: {', '.join(rank['streaming_loaders'])}")
        if rank["loaders_run_out"] is not None:
            ran_out = ", ".join(str(i) for i in rank["loaders_run_out"]) or "none yet"
            line(f"  cycled train loaders that ran out in the epoch: {ran_out}")
        line(f"  process streams sha256 {rank['process_streams_sha256']}")
        checked = ", ".join(rank["restore_check"]) or "nothing (written without the restore digests)"
        line(f"  restore check compares: {checked}")
        for name, value in sorted(rank["epoch_start_attributes"].items()):
            line(f"  set by the epoch-start hooks: {name} = {value}")
        if rank["generators"]:
            line(f"  own generators: {', '.join(rank['generators'])}")
        if rank["own_logged_values"]:
            line(f"  own logged values (unlike rank 0's): {', '.join(rank['own_logged_values'])}")
        if rank["batch_end"]:
            line(f"  for the rest of on_train_batch_end: {rank['batch_end']}")
        if rank["gradients_carried"]:
            line(f"  gradients carried into the next batch: {len(rank['gradients_carried'])} tensor(s)")
        if rank["trace_tail_steps"]:
            first, last = rank["trace_tail_steps"]
            line(f"  step trace tail: steps {first}..{last}")
    manifest = report["manifest"]
    if manifest:
        commit = manifest["git_commit"] or f"no git (files sha256 {manifest['files_sha256']})"
        dirty = " (dirty)" if manifest["dirty"] else ""
        versions = ", ".join(f"{k} {manifest[k]}" for k in ("python", "torch", "lightning", "numpy", "lightning_repro"))
        line(f"manifest: code {commit}{dirty}; {versions}")
    drift = report.get("drift_from_here")
    if drift is not None:
        changed = [f"{c['field']} ({c['kind']})" for c in drift["changes"]]
        verdict = "can break bitwise continuation" if drift["breaks"] else "nothing that can break bitwise continuation"
        said = f"{', '.join(changed)}: {verdict}" if changed else "none in what it records"
        line(f"drift from this environment: {said} (details: lightning-repro env --compare CKPT)")


def _drift(entry: Entry) -> dict[str, Any] | None:
    """The entry's manifest (or older fingerprint) against this environment, as ``env --compare`` finds it."""
    from lightning_repro.manifest.collect import collect_manifest
    from lightning_repro.manifest.drift import drift_from_here

    if entry.manifest is None and not entry.environment:
        return None
    saved, legacy = (entry.manifest, False) if entry.manifest is not None else (entry.environment, True)
    drift, _ = drift_from_here(saved, legacy, collect_manifest() if not legacy else {})
    return drift.to_dict()


def inspect_command(args: argparse.Namespace, console: Console) -> int:
    """``lightning-repro inspect CKPT [--json]``: the entry's summary (exit 0), or damaged (1): see the module."""
    from lightning_repro.checkpoint.entry import DIGEST_KEY, Entry
    from lightning_repro.checkpoint.reading import distributed_parts_problem

    try:
        checkpoint, state_key, raw = load_entry(args.checkpoint)
        if Path(args.checkpoint).is_dir() and (problem := distributed_parts_problem(Path(args.checkpoint))):
            raise CheckpointReadError(f"{args.checkpoint}: damaged: {problem}")
        entry = Entry.from_dict(raw)
    except (CorruptStateError, CheckpointReadError) as error:  # damaged: a result, not bad input (--json: JSON)
        key = None if isinstance(error, CheckpointReadError) else state_key
        if args.json:
            damaged = {"checkpoint": str(args.checkpoint), "state_key": key, "whole": False, "problem": str(error)}
            console.out(json.dumps(damaged, indent=2), highlight=False)
        else:  # a file cut short names itself
            said = str(error) if key is None else f"{args.checkpoint}: {error}"
            console.print(said, markup=False, highlight=False)
        return 1
    except ReproError as error:  # a newer entry than this lightning-repro reads
        raise InputError(str(error)) from None
    report = summarize(checkpoint, state_key, entry, sealed=DIGEST_KEY in raw)
    report["drift_from_here"] = _drift(entry)
    if args.json:  # the keys a damaged entry's object has too: one schema for scripts
        whole = {"checkpoint": str(args.checkpoint), "state_key": state_key, "whole": True, **report}
        console.out(json.dumps(whole, indent=2, default=str), highlight=False)
    else:
        _print(str(args.checkpoint), report, console)
    return 0
