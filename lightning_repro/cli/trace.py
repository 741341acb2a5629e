"""``lightning-repro diff A B [--json] [--plot FILE.png]``: the report of :func:`~lightning_repro.trace.diff_traces`.

Exit codes: 0 when the traces agree on every common step, 1 when they diverge, 2 on bad input (raised as
:class:`~lightning_repro.InputError`, printed as one line by :mod:`lightning_repro.cli.main`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from lightning_repro.exceptions import InputError
from lightning_repro.trace.diff import TraceDiff, diff_trace_paths
from lightning_repro.trace.records import Trace, decode_loss

if TYPE_CHECKING:
    import argparse

    from rich.console import Console

__all__ = ["diff_command", "plot_losses"]

_FIELDS = ("epoch", "batch", "indices", "data", "streams", "loss", "params")


def diff_command(args: argparse.Namespace, console: Console) -> int:
    """Compare the traces ``args.a`` and ``args.b`` rank by rank; print a table (or ``--json``); 0, 1 (or 2)."""
    found = diff_trace_paths(args.a, args.b)
    a, b, diffs, first, notes = found.a, found.b, found.diffs, found.first, found.notes
    if not any(d.common_steps for d in diffs):  # nothing compared is no agreement: exit 2, not 0
        sides = ((args.a, a), (args.b, b))
        empty = [str(path) for path, traces in sides if not any(t.records for t in traces.values())]
        why = f"{' and '.join(empty)}: no step record" if empty else "the traces have no step in common"
        raise InputError(f"{why}, nothing to compare" + "".join(f" ({note})" for note in notes))
    if args.plot:
        plot_losses(a[first.rank], b[first.rank], first, args.plot, labels=(str(args.a), str(args.b)))
    if args.json:
        report: dict[str, Any] = {**first.to_dict(), "notes": notes}
        if len(diffs) > 1:
            report["ranks"] = [d.to_dict() for d in diffs]
        print(json.dumps(report, indent=2))
    else:
        _print_report(console, diffs, first, notes, str(args.a), str(args.b))
        if args.plot:
            console.print(f"loss curves written to {args.plot}")
    return 1 if found.diverged else 0


def _print_report(console: Console, diffs: list[TraceDiff], first: TraceDiff, notes: list[str], a: str, b: str) -> None:
    from rich.table import Table

    summary = Table(title=f"lightning-repro diff\nA: {a}\nB: {b}", title_justify="left")
    for column in ("rank", "common steps", "first divergent step", "last equal step", "field", "cause"):
        summary.add_column(column)
    for d in diffs:
        summary.add_row(
            str(d.rank),
            str(d.common_steps),
            _text(d.first_divergent_step),
            _text(d.last_equal_step),
            _text(d.field),
            _text(d.cause),
        )
    console.print(summary)
    if first.a is not None and first.b is not None:
        records = Table(title=f"rank {first.rank}, step {first.first_divergent_step}", title_justify="left")
        for column in ("field", "A", "B", ""):
            records.add_column(column, overflow="fold")  # a digest is never cut
        for name in _FIELDS:
            left, right = getattr(first.a, name), getattr(first.b, name)
            mark = "differs" if left != right and left is not None and right is not None else ""
            records.add_row(name, _text(left), _text(right), mark)
        console.print(records)
    console.print(first.explanation(), markup=False, highlight=False)
    for note in notes:
        console.print(f"note: {note}", markup=False, highlight=False)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def plot_losses(a: Trace, b: Trace, diff: TraceDiff, path: str, *, labels: tuple[str, str] = ("A", "B")) -> None:
    """Draw the loss curves of ``a`` and ``b`` (decoded from their bits) and mark the divergence; write ``path``.

    Raises:
        InputError: matplotlib is not installed, or ``path`` cannot be written.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError(
            "--plot needs matplotlib, which is not installed: pip install 'lightning-repro[plot]' (or matplotlib)"
        ) from None
    figure = Figure(figsize=(8, 4.5))
    formats = figure.canvas.get_supported_filetypes()  # the format is the file's extension: no other file is written
    if os.path.isdir(path) or os.path.splitext(path)[1].lstrip(".").lower() not in formats:
        what = "is a directory" if os.path.isdir(path) else "has no extension of a format matplotlib writes"
        raise InputError(f"--plot {path}: {what} (name a file such as losses.png; formats: {', '.join(formats)})")
    axes = figure.subplots()
    for trace, label, style in ((a, labels[0], "-"), (b, labels[1], "--")):
        points = [(r.step, decode_loss(r.loss)) for r in trace.records]
        steps = [step for step, loss in points if loss is not None]
        axes.plot(steps, [loss for _, loss in points if loss is not None], style, label=f"{label}", linewidth=1.2)
    if diff.first_divergent_step is not None:
        axes.axvline(diff.first_divergent_step, color="red", linestyle=":", linewidth=1.5)
        axes.set_title(
            f"rank {diff.rank}: diverges at step {diff.first_divergent_step} ({diff.field}, {diff.cause})", fontsize=10
        )
    else:
        axes.set_title(f"rank {diff.rank}: {diff.common_steps} common steps agree bitwise", fontsize=10)
    axes.set_xlabel("global step")
    axes.set_ylabel("loss")
    axes.legend(fontsize=8)
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        why = f"{type(error).__name__}: {error.strerror or error}"
        raise InputError(f"--plot {path}: cannot write it ({why})") from None
