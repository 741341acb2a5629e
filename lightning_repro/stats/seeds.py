"""Multi-seed statistics: a training function over K seeds, each in a fresh process, and bands to check against.

One seed is not evidence. :func:`run_seeds` runs ``fn(seed) -> {metric: value}`` once per seed, each in its own
process, and returns a :class:`SeedReport`: per metric the n values, their mean, the sample standard deviation
(ddof=1), the confidence interval of the mean (Student's t) and the prediction band for one new run.
:func:`check_band` says whether a new run's value falls inside a saved report's band.

Which band: a single new run varies like one seed does, not like the mean of n seeds, so it is compared with
the *prediction* band ``mean ± t * s * sqrt(1 + 1/n)`` (the default). The confidence interval of the mean,
``mean ± t * s / sqrt(n)``, says where the true mean lies; it is roughly ``sqrt(n + 1)`` times narrower, and a
single run falls outside it far more often than 5% of the time. Both assume the metric is roughly normal
across seeds; ``t`` is Student's quantile ``t_{(1 + confidence) / 2, n - 1}`` from scipy (the ``stats`` extra).

Non-finite values (a diverged run's ``nan`` loss) are kept in the per-seed values and named in the metric's
note; that metric's mean, std and bands are then undefined (``None``), the other metrics are unaffected.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_repro.exceptions import InputError, ReproWarning, SeedRunError
from lightning_repro.seeding import validate_seed
from lightning_repro.stats.process import (
    START_METHODS,
    SeedFailure,
    SeedOutcome,
    StartMethod,
    TrainFunction,
    describe_target,
    fork_server,
    run_in_fresh_process,
)
from lightning_repro.stats.report import (
    BandCheck,
    MetricSummary,
    SeedReport,
    check_band,
    report_table,
    student_t,
    summarize,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "REPORT_OF_THE_OTHERS",
    "BandCheck",
    "MetricSummary",
    "SeedReport",
    "check_band",
    "print_report",
    "report_table",
    "run_seeds",
    "summarize",
]


def run_seeds(
    fn: str | TrainFunction,
    seeds: Iterable[int],
    metrics: Sequence[str] | None = None,
    *,
    out: str | os.PathLike[str] | None = None,
    confidence: float = 0.95,
    start_method: StartMethod = "spawn",
    timeout: float | None = None,
    stop_on_failure: bool = False,
    log_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> SeedReport:
    """Run ``fn(seed)`` once per seed, each in a fresh process, and summarize the metrics it returns.

    Each seed's process starts with ``PYTHONHASHSEED`` fixed (the parent's when it is fixed, else 0), so what a
    seed gives depends on the seed alone; ``fn`` should build its ``DeterminismCallback(seed)`` (first, before
    the model) from the seed it receives. Its stdout and stderr go to ``log_dir/seed-<seed>.log``.

    Args:
        fn: A module-level function taking a seed and returning ``{metric: number}`` (numbers, numpy scalars
            or one-element tensors), or its ``"module:function"`` / ``"path/to/file.py:function"`` name.
        seeds: The seeds, distinct ints in ``[0, 2**32 - 1]``.
        metrics: The metrics to report; ``None``: all that the first seed returned. Every seed must return them.
        out: Write the report here as JSON (also when some seeds failed: the report of the others).
        confidence: The level of the interval of the mean and of the prediction band.
        start_method: ``"spawn"`` (a new interpreter per seed), or ``"forkserver"`` (imports lightning_repro
            once in a server process and forks each seed from it: faster for short runs; not on Windows; the
            server keeps the environment variables it started with).
        timeout: Seconds a seed's function may run before its process is killed (and the seed counted as failed);
            the process's start-up (a fork server's first imports) is not counted.
        stop_on_failure: Stop at the first failed seed instead of running the others.
        log_dir: Where the seeds' output goes; ``None``: a temporary directory, removed at the end (the last
            lines of a failed seed's output are in the error).
        progress: Draw a progress bar across the seeds on stderr; ``None``: when stderr is a terminal.

    Returns:
        The report (metric -> n, mean, std, intervals, the values per seed), also written to ``out``.

    Raises:
        SeedRunError: a seed raised, crashed or timed out (after the other seeds ran, unless
            ``stop_on_failure``); its ``report`` holds the statistics of the seeds that succeeded.
        InputError: ``fn`` cannot be imported, or a seed's result is not a dict or lacks a metric (the message
            names the seed and the metric); the remaining seeds are not run. The report of the seeds that ran
            before it is written to ``out`` when given (the message says so).
        ImportError: scipy (the ``stats`` extra) is missing, checked before any seed runs.

    Example::

        report = run_seeds("examples.multi_seed:train", range(5), ["val_acc"], out="seeds.json")
        print(report.metrics["val_acc"].ci)
        check_band("seeds.json", new_val_acc, metric="val_acc").inside
    """
    seed_list = _validate(seeds, metrics, confidence, start_method, timeout)
    if out is not None:
        _check_out(out)  # before hours of training: the report must be writable there
    if len(seed_list) > 1:
        student_t(confidence, len(seed_list) - 1)  # scipy missing: say so before hours of training
    target = describe_target(fn)
    ran: tuple[dict[int, dict[str, float]], list[SeedFailure], dict[str, str]] = ({}, [], {})
    with tempfile.TemporaryDirectory(prefix="lightning-repro-seeds-") as scratch:
        logs = Path(log_dir) if log_dir is not None else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        try:
            _run_all(fn, target, seed_list, metrics, start_method, timeout, stop_on_failure, logs, progress, ran)
        except InputError as error:  # a seed's result: the seeds that ran before it are not lost when `out` is given
            if not ran[0] or out is None:
                raise
            _report(target, metrics, confidence, ran, out, warn_notes=False)
            said = f"The report of the {_seeds(len(ran[0]))} that ran before it is in {str(out)!r}"
            raise InputError(f"{error}. {said}") from None
    results, failures, _ = ran
    report = _report(target, metrics, confidence, ran, out)
    if failures or report is None:
        message = _failure_message(failures, len(seed_list), len(failures) + len(results), out)
        raise SeedRunError(message, failures={f.seed: f.reason for f in failures}, report=report)
    return report


def _check_out(out: str | os.PathLike[str]) -> None:
    """Refuse an ``out`` the report cannot be written to (as :meth:`SeedReport.save` writes it), before any seed."""
    target = Path(out)
    if target.is_dir():
        example = str(target / "seeds.json")
        raise InputError(f"`out` {str(out)!r} is a directory: give the report's file name, e.g. {example!r}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp"):
            pass
    except OSError as error:
        raise InputError(f"`out` {str(out)!r} cannot be written: {error.strerror or error}") from None


def _seeds(count: int) -> str:
    return f"{count} seed" + ("s" if count != 1 else "")


def _report(
    target: str,
    metrics: Sequence[str] | None,
    confidence: float,
    ran: tuple[dict[int, dict[str, float]], list[SeedFailure], dict[str, str]],
    out: str | os.PathLike[str] | None,
    *,
    warn_notes: bool = True,
) -> SeedReport | None:
    """The report of the seeds that returned their metrics (``None``: none did), written to ``out`` when given."""
    results, failures, environment = ran
    if not results:
        return None
    names = list(metrics) if metrics is not None else list(next(iter(results.values())))
    columns = {name: [results[seed][name] for seed in results] for name in names}
    reasons = {failure.seed: failure.reason for failure in failures}
    report = SeedReport.from_values(
        target, list(results), columns, confidence=confidence, failures=reasons, environment=environment
    )
    if warn_notes:
        _warn_notes(report)
    if out is not None:
        report.save(out)
    return report


def _validate(
    seeds: Iterable[int],
    metrics: Sequence[str] | None,
    confidence: float,
    start_method: str,
    timeout: float | None,
) -> list[int]:
    seed_list = [validate_seed(seed, f"seeds[{i}]") for i, seed in enumerate(seeds)]
    if not seed_list:
        raise ValueError("`seeds` is empty; pass the seeds to run, for example `seeds=range(5)`")
    repeated = sorted({s for s in seed_list if seed_list.count(s) > 1})
    if repeated:
        raise ValueError(f"`seeds` repeats {repeated}: each seed runs once (a seed's run is deterministic)")
    if isinstance(metrics, str) or (metrics is not None and not all(isinstance(m, str) for m in metrics)):
        raise TypeError(f"`metrics` must be a list of metric names, got {metrics!r}; for example `['val_acc']`")
    if metrics is not None and not metrics:
        raise ValueError("`metrics` is empty; pass the metric names, or None for all that the function returns")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}; for example `confidence=0.95`")
    if start_method not in START_METHODS:
        raise ValueError(f"`start_method` must be one of {list(START_METHODS)}, got {start_method!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"`timeout` must be a positive number of seconds or None, got {timeout!r}")
    return seed_list


def _run_all(
    fn: str | TrainFunction,
    target: str,
    seeds: list[int],
    metrics: Sequence[str] | None,
    start_method: StartMethod,
    timeout: float | None,
    stop_on_failure: bool,
    logs: Path,
    progress: bool | None,
    ran: tuple[dict[int, dict[str, float]], list[SeedFailure], dict[str, str]],
) -> None:
    """Run the seeds one after the other under a progress bar, into ``ran``.

    ``ran``: each seed's values, the failures, the environment, filled as the seeds run (what ran is there when a
    seed's result raises :class:`InputError`).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    shown = console.is_terminal if progress is None else progress
    results, failures, environment = ran
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    server = fork_server(["__main__", "lightning_repro"]) if start_method == "forkserver" else contextlib.nullcontext()
    with server, Progress(*columns, console=console, disable=not shown) as bar:
        task = bar.add_task(f"{target}: seeds", total=len(seeds))
        for seed in seeds:
            bar.update(task, description=f"{target}: seed {seed}")
            outcome = run_in_fresh_process(
                fn, seed, start_method=start_method, log_path=logs / f"seed-{seed}.log", timeout=timeout
            )
            bar.advance(task)
            if outcome.failure is not None:
                failures.append(outcome.failure)
                if stop_on_failure:
                    break
                continue
            wanted = list(metrics) if metrics is not None else (list(next(iter(results.values()))) if results else [])
            results[seed] = _checked(outcome, target, wanted)
            if metrics is None and len(results) > 1:
                _warn_extra(outcome, target, wanted, next(iter(results)))
            if not environment:
                environment.update(outcome.environment)


def _checked(outcome: SeedOutcome, target: str, wanted: list[str]) -> dict[str, float]:
    """The seed's values of the ``wanted`` metrics (all of them for the first seed when none are named)."""
    seed = outcome.seed
    if outcome.not_a_mapping is not None:
        raise InputError(f"seed {seed}: {target} {outcome.not_a_mapping}")
    names = wanted or [*outcome.values, *outcome.bad]
    for name in names:
        if name in outcome.bad:
            raise InputError(f"seed {seed}: metric {name!r} of {target} is not a number: {outcome.bad[name]}")
        if name not in outcome.values:
            returned = sorted([*outcome.values, *outcome.bad])
            raise InputError(f"seed {seed}: {target} returned no metric {name!r} (it returned {returned})")
    if not names:
        raise InputError(f"seed {seed}: {target} returned an empty dict; return {{metric name: number}}")
    return {name: outcome.values[name] for name in names}


def _warn_extra(outcome: SeedOutcome, target: str, wanted: list[str], first: int) -> None:
    """A seed returned metrics the first seed did not: they are not reported (a metric is every seed's, or none's)."""
    extra = sorted({*outcome.values, *outcome.bad} - set(wanted))
    if extra:
        from lightning_repro._warn import warn

        warn(
            f"run_seeds: seed {outcome.seed} of {target} returned {extra}, which seed {first} (the first) did not:"
            " not reported (the report holds the metrics every seed returns; name them in `metrics` to require them)",
            ReproWarning,
        )


def _warn_notes(report: SeedReport) -> None:
    from lightning_repro._warn import warn

    for name, summary in report.metrics.items():
        if summary.note and summary.n > 1:  # a non-finite value (one seed is said in the report only)
            warn(f"run_seeds: metric {name!r}: {summary.note}", ReproWarning)


REPORT_OF_THE_OTHERS = "The report of the others is in `error.report`"
"""What a :class:`~lightning_repro.SeedRunError` says of the seeds that ran (the CLI prints that report instead)."""


def _failure_message(failures: list[SeedFailure], total: int, ran: int, out: str | os.PathLike[str] | None) -> str:
    head = f"{len(failures)} of {total} seeds failed: " + "; ".join(str(f) for f in failures)
    if ran < total:
        head += f". Stopped at the first failure: {total - ran} seeds did not run"
    if ran > len(failures):
        head += f". {REPORT_OF_THE_OTHERS}" + (f" and in {str(out)!r}" if out else "")
    details = [f"--- seed {f.seed}: {f.reason}\n{f.details.rstrip()}" for f in failures if f.details]
    return "\n".join([head, *details])


# ------------------------------------------------------------------------------------------ lightning-repro seeds


def print_report(report: SeedReport, console: Console | None = None) -> None:
    """Print ``report``'s table (:func:`report_table`) on ``console`` (default: stdout).

    Not on a terminal (a pipe, a log file), the table is printed at least 120 columns wide so that no cell wraps.
    """
    if console is None:
        from rich.console import Console as RichConsole

        console = RichConsole()
    if not console.is_terminal:
        console.width = max(console.width, 120)
    console.print(report_table(report))


