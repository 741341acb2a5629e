"""``lightning-repro env [--json] [--compare FILE]``: this environment's manifest, or its drift from a saved one."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_repro.manifest.codestate import checkout_root
from lightning_repro.manifest.collect import collect_manifest
from lightning_repro.manifest.drift import LAUNCHER_SET, drift_from_here, find_manifest, flatten

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["compare_command", "env_command", "print_manifest"]


def env_command(args: argparse.Namespace, console: Console) -> int:
    """``lightning-repro env [--json] [--compare FILE]``: this manifest, or its drift from a saved one (exit code)."""
    current = collect_manifest()
    if args.compare:
        return compare_command(args.compare, current, console, as_json=bool(args.json))
    if args.json:
        console.out(json.dumps(current, indent=2, sort_keys=True), highlight=False)
        return 0
    print_manifest(current, console)
    return 0


def compare_command(path: str, current: dict[str, Any], console: Console, *, as_json: bool = False) -> int:
    """``env --compare FILE``: print the drift from the saved manifest; 1 when something breaks continuation."""
    drift, not_compared = drift_from_here(*find_manifest(path), current)
    if as_json:
        report = {**drift.to_dict(), "not_compared": not_compared}
        console.out(json.dumps(report, indent=2, default=str), highlight=False)
    elif not drift.changes:
        what = "what it records of " if drift.not_recorded else ""
        console.print(f"No drift: this environment matches {what}{path}.", markup=False, highlight=False)
    else:
        from rich.table import Table

        table = Table(title=f"Drift from {path}")
        table.add_column("field", no_wrap=True)
        for column in ("saved", "current", "class"):
            table.add_column(column, overflow="fold")
        for change in drift.changes:
            table.add_row(change.field, _short(change.saved), _short(change.current), change.kind)
        console.print(table)
        verdict = (
            "Something that can break bitwise continuation changed."
            if drift.breaks
            else "Nothing that can break bitwise continuation changed."
        )
        console.print(verdict, markup=False, highlight=False)
        if any(change.field.startswith("code.") for change in drift.changes):
            console.print(_code_compared(), markup=False, highlight=False)
    if drift.not_recorded and not as_json:
        console.print(drift.not_recorded_message() + ".", markup=False, highlight=False)
    if not as_json:
        console.print(_not_compared_message(not_compared), markup=False, highlight=False)
    return 1 if drift.breaks else 0


def _code_compared() -> str:
    """Whose code the ``code.*`` rows compare: this directory's checkout, which need not be the run's."""
    root = checkout_root(Path.cwd().resolve())
    where = f"the git checkout at {root}" if root is not None else f"{Path.cwd()} (not in a git checkout)"
    return f"code: compared with {where}, the current directory's."


def _not_compared_message(not_compared: list[str]) -> str:
    """Why each section left out was not compared (a resume compares them all)."""
    run_set = [name for name in not_compared if name not in ("code", LAUNCHER_SET)]
    said = [
        f"{', '.join(run_set)}: what the run sets or chooses itself, which this command cannot know" if run_set else "",
        "code: the run was outside git, and its files were digested from the run's own module, which this command"
        " does not know"
        if "code" in not_compared
        else "",
        f"{LAUNCHER_SET}: a multi-process run's launcher (Lightning's, torchrun) set them in each rank, this shell"
        " does not"
        if LAUNCHER_SET in not_compared
        else "",
    ]
    return "Not compared: " + "; ".join(filter(None, said)) + " (a resume compares them)."


def _short(value: Any) -> str:
    """A value for a table cell: a digest shortened to its first 12 characters (``--json`` prints it whole)."""
    text = repr(value)
    return text[:13] + "…'" if isinstance(value, str) and len(value) == 64 else text


def print_manifest(manifest: Mapping[str, Any], console: Console) -> None:
    """One rich table per section of the manifest."""
    from rich.table import Table

    for section, values in manifest.items():
        if not isinstance(values, Mapping):
            continue
        table = Table(title=section, show_header=False)
        table.add_column("field")
        table.add_column("value", overflow="fold")
        for key, value in flatten(values).items():
            table.add_row(key, "" if value is None else str(value))
        console.print(table)

