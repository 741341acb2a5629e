"""The multi-seed report: per-metric statistics, its JSON form, the band check and its table.

Public through :mod:`lightning_repro.stats.seeds` (see there for which band to use and why).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_repro.exceptions import InputError

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "REPORT_KIND",
    "REPORT_VERSION",
    "Band",
    "BandCheck",
    "MetricSummary",
    "SeedReport",
    "check_band",
    "report_table",
    "student_t",
    "summarize",
]

REPORT_KIND = "lightning-repro seed report"
REPORT_VERSION = 1
Band = Literal["prediction", "confidence"]
_BAND_NAMES = {"prediction": "prediction band for one new run", "confidence": "confidence interval of the mean"}
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_INSTALL_STATS = 'pip install "lightning-repro[stats]"'


def student_t(confidence: float, dof: int) -> float:
    """Student's t quantile ``t_{(1 + confidence) / 2, dof}`` (two-sided), from scipy.

    Raises:
        ImportError: scipy is not installed; the message says how to install it.

    Examples:
        >>> round(student_t(0.95, 4), 6)
        2.776445
    """
    try:
        from scipy.stats import t  # type: ignore[import-untyped]
    except ImportError as error:
        raise ImportError(
            f"multi-seed statistics need scipy for Student's t quantile: {_INSTALL_STATS} (or pip install scipy)"
        ) from error
    return float(t.ppf((1.0 + confidence) / 2.0, dof))


def _percent(confidence: float) -> str:
    return f"{confidence * 100:g}%"


@dataclass(frozen=True)
class MetricSummary:
    """One metric over the seeds: ``values`` in the report's seed order, and what they give.

    ``mean``, ``std`` (sample, ddof=1), ``t`` and the bands are ``None`` where undefined (one seed; a non-finite
    value), and ``note`` says why. ``ci`` is the confidence interval of the mean, ``prediction`` the band for one
    new run (see :mod:`lightning_repro.stats.seeds`).
    """

    name: str
    values: tuple[float, ...]
    mean: float | None
    std: float | None
    t: float | None
    ci: tuple[float, float] | None
    prediction: tuple[float, float] | None
    note: str | None = None

    @property
    def n(self) -> int:
        """How many seeds gave a value."""
        return len(self.values)

    def band(self, band: Band) -> tuple[float, float] | None:
        """The ``"prediction"`` band or the ``"confidence"`` interval of the mean."""
        return self.prediction if band == "prediction" else self.ci


def summarize(
    name: str, values: Sequence[float], *, confidence: float = 0.95, seeds: Sequence[int] | None = None
) -> MetricSummary:
    """Mean, sample standard deviation, Student-t confidence interval of the mean and prediction band.

    Args:
        name: The metric's name.
        values: One value per seed (at least one).
        confidence: The level of both intervals, in (0, 1).
        seeds: The seeds of ``values``, to name them in the note about a non-finite value.

    Examples:
        >>> s = summarize("loss", [1.0, 2.0, 3.0, 4.0, 5.0])
        >>> s.mean, s.std == 2.5 ** 0.5, [round(x, 4) for x in s.ci]
        (3.0, True, [1.0368, 4.9632])
    """
    xs = tuple(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise ValueError(f"`values` of metric {name!r} is empty; a summary needs at least one value")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}; for example `confidence=0.95`")
    bad = [i for i, x in enumerate(xs) if not math.isfinite(x)]
    if bad:
        gave = ", ".join(f"{f'seed {seeds[i]}' if seeds is not None else f'value {i}'} gave {xs[i]}" for i in bad)
        note = f"{gave}: mean, std and bands are undefined"
        return MetricSummary(name, xs, None, None, None, None, None, note)
    mean = math.fsum(xs) / n
    if n == 1:
        note = "one seed: the standard deviation and the intervals need at least 2"
        return MetricSummary(name, xs, mean, None, None, None, None, note)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    t = student_t(confidence, n - 1)
    half_ci = t * std / math.sqrt(n)
    half_prediction = t * std * math.sqrt(1.0 + 1.0 / n)
    return MetricSummary(
        name, xs, mean, std, t, (mean - half_ci, mean + half_ci), (mean - half_prediction, mean + half_prediction)
    )


@dataclass(frozen=True)
class SeedReport:
    """The result of :func:`~lightning_repro.stats.seeds.run_seeds`: one :class:`MetricSummary` per metric.

    ``seeds`` are the seeds that returned values, in order; ``failures`` maps the seeds that did not to why;
    ``environment`` is where the first seed ran (versions, hardware, flags). Saved as JSON (:meth:`save`).
    """

    target: str
    seeds: tuple[int, ...]
    metrics: dict[str, MetricSummary]
    confidence: float = 0.95
    failures: dict[int, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_values(
        cls,
        target: str,
        seeds: Sequence[int],
        values: Mapping[str, Sequence[float]],
        *,
        confidence: float = 0.95,
        failures: Mapping[int, str] | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> SeedReport:
        """Summarize ``values`` (metric -> one value per seed of ``seeds``).

        Examples:
            >>> report = SeedReport.from_values("train:fit", [0, 1, 2], {"acc": [0.90, 0.92, 0.91]})
            >>> round(report.metrics["acc"].mean, 6), report.metrics["acc"].n
            (0.91, 3)
        """
        for name, column in values.items():
            if len(column) != len(seeds):
                raise ValueError(f"metric {name!r} has {len(column)} values for {len(seeds)} seeds")
        summaries = {
            name: summarize(name, column, confidence=confidence, seeds=seeds) for name, column in values.items()
        }
        return cls(target, tuple(seeds), summaries, confidence, dict(failures or {}), dict(environment or {}))

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON: non-finite values as the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
        return {
            "kind": REPORT_KIND,
            "version": REPORT_VERSION,
            "target": self.target,
            "confidence": self.confidence,
            "seeds": list(self.seeds),
            "metrics": {
                name: {
                    "n": m.n,
                    "mean": m.mean,
                    "std": m.std,
                    "t": m.t,
                    "ci": list(m.ci) if m.ci else None,
                    "prediction": list(m.prediction) if m.prediction else None,
                    "values": [x if math.isfinite(x) else str(x) for x in m.values],
                    "note": m.note,
                }
                for name, m in self.metrics.items()
            },
            "failures": {str(seed): reason for seed, reason in self.failures.items()},
            "environment": dict(self.environment),
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "report") -> SeedReport:
        """The report :meth:`to_dict` gave; ``source`` names it in errors.

        Raises:
            InputError: ``data`` is not such a report (the message names the key).
        """
        if not isinstance(data, Mapping) or data.get("kind") != REPORT_KIND:
            raise InputError(f'{source}: not a lightning-repro seed report (no "kind": {REPORT_KIND!r})')
        version = data.get("version")
        if not isinstance(version, int) or version > REPORT_VERSION:
            raise InputError(f"{source}: report version {version!r} is not one this lightning-repro reads (1)")
        try:
            seeds = tuple(int(s) for s in data["seeds"])
            metrics = {}
            for name, m in data["metrics"].items():
                metrics[str(name)] = MetricSummary(
                    str(name),
                    tuple(_number(x) for x in m["values"]),
                    _optional(m.get("mean")),
                    _optional(m.get("std")),
                    _optional(m.get("t")),
                    _pair(m.get("ci")),
                    _pair(m.get("prediction")),
                    m.get("note"),
                )
                if metrics[str(name)].n != len(seeds):
                    raise ValueError(f"metric {name!r} has {metrics[str(name)].n} values for {len(seeds)} seeds")
            return cls(
                str(data["target"]),
                seeds,
                metrics,
                float(data["confidence"]),
                {int(k): str(v) for k, v in data.get("failures", {}).items()},
                {str(k): str(v) for k, v in data.get("environment", {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            what = f"missing key {error}" if isinstance(error, KeyError) else str(error)
            raise InputError(f"{source}: malformed seed report ({what})") from error

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the report as JSON to ``path`` (atomically: a reader never sees half a file); return the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as handle:
            handle.write(text)
        try:
            os.replace(handle.name, target)
        except OSError:
            os.unlink(handle.name)  # no temporary file left beside the report (a directory there, say)
            raise
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SeedReport:
        """Read a report :meth:`save` wrote.

        Raises:
            InputError: the file is missing, not JSON, or not a seed report.
        """
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise InputError(f"seed report {str(path)!r}: cannot read it ({error.strerror or error})") from error
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise InputError(f"seed report {str(path)!r}: not JSON ({error})") from error
        return cls.from_dict(data, source=f"seed report {str(path)!r}")


def _number(value: Any) -> float:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


def _optional(value: Any) -> float | None:
    return None if value is None else _number(value)


def _pair(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    low, high = value
    return _number(low), _number(high)


@dataclass(frozen=True)
class BandCheck:
    """Whether ``value`` lies inside ``[low, high]``, the report's band for ``metric``; true as a bool when inside."""

    metric: str
    value: float
    inside: bool
    low: float
    high: float
    band: Band
    confidence: float
    n: int
    mean: float

    def __bool__(self) -> bool:
        return self.inside

    @property
    def message(self) -> str:
        """One line: the value, the band, and how far outside it the value is."""
        where = (
            f"the {_percent(self.confidence)} {_BAND_NAMES[self.band]} [{self.low:.6g}, {self.high:.6g}]"
            f" of {self.n} seeds (mean {self.mean:.6g})"
        )
        if self.inside:
            return f"{self.metric} = {self.value:.6g} is inside {where}"
        if not math.isfinite(self.value):
            return f"{self.metric} = {self.value} is outside {where}: not a finite number"
        side, gap = ("below", self.low - self.value) if self.value < self.low else ("above", self.value - self.high)
        return f"{self.metric} = {self.value:.6g} is outside {where}: {gap:.3g} {side} it"


def check_band(
    report: SeedReport | str | os.PathLike[str],
    value: float,
    *,
    metric: str | None = None,
    band: Band = "prediction",
) -> BandCheck:
    """Whether a new run's ``value`` of ``metric`` lies inside a reference report's band (bounds included).

    Args:
        report: A :class:`SeedReport`, or the path of one saved as JSON.
        value: The new run's value.
        metric: The metric; may be left out when the report has only one.
        band: ``"prediction"`` (default): the band for one new run, ``mean ± t * s * sqrt(1 + 1/n)``, right for
            the value of a single run. ``"confidence"``: the interval of the reference mean,
            ``mean ± t * s / sqrt(n)``, for a value that is itself a mean over many runs.

    Raises:
        InputError: the report cannot be read, has no such metric, or its band for it is undefined (one seed,
            or a non-finite value).

    Examples:
        >>> ref = SeedReport.from_values("train:fit", [0, 1, 2, 3, 4], {"acc": [0.90, 0.92, 0.91, 0.93, 0.89]})
        >>> check_band(ref, 0.915).inside, check_band(ref, 0.80).inside
        (True, False)
    """
    if band not in _BAND_NAMES:
        raise ValueError(f"`band` must be 'prediction' or 'confidence', got {band!r}")
    if not isinstance(report, SeedReport):
        report = SeedReport.load(report)
    if metric is None:
        if len(report.metrics) != 1:
            raise InputError(f"the report has metrics {sorted(report.metrics)}: pass `metric=` to pick one")
        metric = next(iter(report.metrics))
    summary = report.metrics.get(metric)
    if summary is None:
        raise InputError(f"the report has no metric {metric!r}; it has {sorted(report.metrics)}")
    bounds = summary.band(band)
    if bounds is None or summary.mean is None:
        raise InputError(f"the report's {band} band of {metric!r} is undefined: {summary.note}")
    value = float(value)
    low, high = bounds
    return BandCheck(metric, value, low <= value <= high, low, high, band, report.confidence, summary.n, summary.mean)


def report_table(report: SeedReport) -> Table:
    """A rich table of ``report``: metric, n, mean, std, the interval of the mean, the prediction band."""
    from rich.table import Table

    pct = _percent(report.confidence)
    seeds = ", ".join(map(str, report.seeds[:8])) + (", ..." if len(report.seeds) > 8 else "")
    count = f"{len(report.seeds)} seed" + ("s" if len(report.seeds) != 1 else "")
    table = Table(title=f"{report.target} over {count} ({seeds})", title_justify="left")
    for column in ("metric", "n", "mean", "std", f"{pct} CI of the mean", f"{pct} prediction band"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    notes = []
    for name, m in report.metrics.items():
        table.add_row(name, str(m.n), _fmt(m.mean), _fmt(m.std), _fmt_pair(m.ci), _fmt_pair(m.prediction))
        if m.note:
            notes.append(f"{name}: {m.note}")
    notes += [f"seed {seed} failed: {reason}" for seed, reason in report.failures.items()]
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _fmt_pair(pair: tuple[float, float] | None) -> str:
    return "-" if pair is None else f"[{pair[0]:.6g}, {pair[1]:.6g}]"
