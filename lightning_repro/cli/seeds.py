"""``lightning-repro seeds TARGET --seeds K``: parse, run :func:`~lightning_repro.stats.run_seeds`, print."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from lightning_repro.exceptions import InputError, SeedRunError
from lightning_repro.seeding import validate_seed
from lightning_repro.stats.report import BandCheck, SeedReport, check_band
from lightning_repro.stats.seeds import REPORT_OF_THE_OTHERS, print_report, run_seeds

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["seeds_command"]


def seeds_command(args: argparse.Namespace, console: Console) -> int:
    """``lightning-repro seeds TARGET --seeds K``: run, print the table (or JSON), check against ``--check``.

    Exit 0 when every seed ran (and every value is inside the ``--check`` band), 1 when a seed failed or a value
    is outside, 2 on bad input (raised as :class:`~lightning_repro.InputError`).
    """
    if args.seeds < 1:
        raise InputError(f"--seeds must be at least 1, got {args.seeds}")
    last = args.first_seed + args.seeds - 1
    for flag, seed in (("--first-seed", args.first_seed), ("--first-seed + --seeds - 1", last)):
        try:  # before the list is built: a huge --seeds is bad input, not an OverflowError
            validate_seed(seed, flag)
        except ValueError as error:
            raise InputError(str(error)) from error
    if args.out and os.path.isdir(args.out):
        raise InputError(f"--out {args.out}: is a directory (give the report's file name, e.g. {args.out}/seeds.json)")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if os.getcwd() not in sys.path:  # TARGET is importable from the current directory (as with python -m)
        sys.path.insert(0, os.getcwd())
    reference = SeedReport.load(args.check) if args.check else None
    metrics = args.metrics or (list(reference.metrics) if reference is not None else None)
    try:
        report = run_seeds(
            args.target,
            seeds,
            metrics,
            out=args.out,
            confidence=args.confidence,
            start_method=args.start_method,
            timeout=args.timeout,
            log_dir=args.log_dir,
        )
    except SeedRunError as error:
        _print(console, error.report, [], as_json=args.json)
        from rich.console import Console as RichConsole

        said = str(error).replace(REPORT_OF_THE_OTHERS, "The report of the others is printed above")
        RichConsole(stderr=True, soft_wrap=True).print(said, markup=False, highlight=False)
        return 1
    except (ValueError, ImportError) as error:  # InputError included; a missing scipy: one line, exit 2
        raise InputError(str(error)) from error
    checks = _checks(report, reference) if reference is not None else []
    _print(console, report, checks, as_json=args.json)
    return 1 if any(not check.inside for _, check in checks) else 0


def _checks(report: SeedReport, reference: SeedReport) -> list[tuple[int, BandCheck]]:
    """Each new seed's value of each metric both reports have, against the reference's prediction band."""
    return [
        (seed, check_band(reference, value, metric=name))
        for name, summary in report.metrics.items()
        if name in reference.metrics
        for seed, value in zip(report.seeds, summary.values, strict=True)
    ]


def _print(console: Console, report: SeedReport | None, checks: list[tuple[int, BandCheck]], *, as_json: bool) -> None:
    if as_json:
        data: dict[str, Any] = report.to_dict() if report is not None else {}
        if checks:
            data["checks"] = [
                {"seed": seed, "metric": c.metric, "value": c.value, "inside": c.inside, "low": c.low, "high": c.high}
                for seed, c in checks
            ]
        console.print(json.dumps(data, indent=2), markup=False, highlight=False)
        return
    if report is not None:
        print_report(report, console)
    for seed, check in checks:
        mark = "[green]inside[/]" if check.inside else "[red]OUTSIDE[/]"
        console.print(f"{mark}  seed {seed}: ", end="")
        console.print(check.message, markup=False, highlight=False)

