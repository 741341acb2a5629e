"""Several seeds: run a training function once per seed in fresh processes, and report intervals.

Owns the runner (``seeds``: :func:`run_seeds`, the printed table), the fresh processes each seed runs in
(``process``: spawn or a fork server, timeouts, captured output) and the report with its statistics and the band
check (``report``: :class:`SeedReport`, :func:`check_band`).

May import the bottom layer only (``exceptions``, ``seeding``, ``_warn``). The ``lightning-repro seeds`` verb is
:mod:`lightning_repro.cli.seeds`.
"""

from __future__ import annotations

from lightning_repro.stats.seeds import (
    BandCheck,
    MetricSummary,
    SeedReport,
    check_band,
    print_report,
    report_table,
    run_seeds,
    summarize,
)

__all__ = [
    "BandCheck",
    "MetricSummary",
    "SeedReport",
    "check_band",
    "print_report",
    "report_table",
    "run_seeds",
    "summarize",
]
