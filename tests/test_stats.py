"""Multi-seed statistics: the numbers on known values, the report's JSON, the band check, failures, the CLI verb.

The tests that run seeds (marked slow) use ``start_method="forkserver"``: one server imports lightning_repro once
per pytest process (~5 s of CPU), then each seed is a fork (~0.1 s), on the pure-Python targets of
``tests/seed_targets.py`` or the real example (``examples/multi_seed.py``) end to end, through the API and the
CLI; one seed of the example also runs with ``spawn`` (the default, a new interpreter) and gives the same bits.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

import lightning_repro
from lightning_repro import InputError, SeedReport, SeedRunError, check_band, run_seeds
from lightning_repro.cli.main import main
from lightning_repro.stats.seeds import report_table, summarize

ROOT = Path(__file__).resolve().parents[1]
T_0975_4 = 2.7764451051977987  # scipy.stats.t.ppf(0.975, 4)
T_0975_2 = 4.302652729749462  # scipy.stats.t.ppf(0.975, 2)
FAST = {"start_method": "forkserver"}


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``seed_targets`` and ``examples`` importable by name (the seeds' processes inherit ``sys.path``)."""
    monkeypatch.setattr(sys, "path", [str(ROOT / "tests"), str(ROOT), *sys.path])


# ------------------------------------------------------------------------------------------ the numbers
def test_mean_std_and_intervals_on_known_values_equal_the_hand_computation() -> None:
    s = summarize("x", [1.0, 2.0, 3.0, 4.0, 5.0])
    # by hand: mean 15 / 5 = 3; s^2 = (4 + 1 + 0 + 1 + 4) / (5 - 1) = 2.5; t_{0.975, 4} = 2.776445105197799 (scipy's
    # last bits differ between versions: 2.7764451051977987 in 1.11, 2.7764451051977934 in the pinned one)
    assert s.n == 5
    assert s.mean == 3.0
    assert s.std == math.sqrt(2.5)
    assert s.t == pytest.approx(T_0975_4, rel=1e-14, abs=0)
    half_ci = s.t * math.sqrt(2.5) / math.sqrt(5)  # 1.963243...
    half_prediction = s.t * math.sqrt(2.5) * math.sqrt(1 + 1 / 5)  # 4.808944...
    assert s.ci == (3.0 - half_ci, 3.0 + half_ci)
    assert s.prediction == (3.0 - half_prediction, 3.0 + half_prediction)
    assert [round(x, 6) for x in s.ci] == [1.036757, 4.963243]
    assert [round(x, 6) for x in s.prediction] == [-1.808944, 7.808944]
    assert s.note is None


def test_another_level_and_three_values() -> None:
    s = summarize("x", [0.5, 0.25, 1.0], confidence=0.99)
    assert s.mean == 1.75 / 3
    assert s.t == pytest.approx(9.924843200918, rel=1e-12)  # t_{0.995, 2}: only the level changed
    assert s.std is not None
    assert s.t is not None
    half = s.t * s.std / math.sqrt(3)
    assert s.ci == (s.mean - half, s.mean + half)


def test_one_seed_has_no_std_nor_interval() -> None:
    report = SeedReport.from_values("m:f", [7], {"loss": [0.5]})
    s = report.metrics["loss"]
    assert (s.n, s.mean, s.std, s.ci, s.prediction) == (1, 0.5, None, None, None)
    assert s.note is not None
    assert "at least 2" in s.note
    with pytest.raises(InputError, match="undefined: one seed"):
        check_band(report, 0.5)
    assert SeedReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert report_table(report).row_count == 1
    assert report_table(report).title == "m:f over 1 seed (7)"  # not "1 seeds"


def test_a_non_finite_value_makes_that_metric_undefined_and_is_named() -> None:
    report = SeedReport.from_values("m:f", [0, 1, 2], {"loss": [0.5, math.nan, 0.4], "acc": [0.9, 0.8, 0.85]})
    assert report.metrics["loss"].mean is None
    assert report.metrics["loss"].note == "seed 1 gave nan: mean, std and bands are undefined"
    assert report.metrics["acc"].mean == pytest.approx(0.85)  # the other metric is not affected
    with pytest.raises(InputError, match="seed 1 gave nan"):
        check_band(report, 0.5, metric="loss")


# --------------------------------------------------------------------------------------------- the JSON
def test_json_round_trip_is_exact(tmp_path: Path) -> None:
    values = {"loss": [0.1 + 0.2, 1 / 3, 2.0**-40], "odd": [math.inf, 1.0, -math.inf]}
    report = SeedReport.from_values("m:f", [3, 1, 2], values, failures={9: "raised ValueError: x"})
    path = report.save(tmp_path / "sub" / "report.json")
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))  # no NaN/Infinity literals
    loaded = SeedReport.load(path)
    assert loaded.to_dict() == report.to_dict()
    assert loaded.seeds == (3, 1, 2)
    assert loaded.failures == {9: "raised ValueError: x"}
    assert [x.hex() for x in loaded.metrics["loss"].values] == [x.hex() for x in values["loss"]]  # bit for bit
    assert loaded.metrics["odd"].values == (math.inf, 1.0, -math.inf)
    assert loaded.metrics["loss"] == report.metrics["loss"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"kind": "something else"}', "not a lightning-repro seed report"),
        ('{"kind": "lightning-repro seed report", "version": 99}', "version 99"),
        ('{"kind": "lightning-repro seed report", "version": 1, "seeds": [0]}', "missing key 'metrics'"),
    ],
)
def test_a_malformed_report_file_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        SeedReport.load(path)
    with pytest.raises(InputError, match="cannot read it"):
        SeedReport.load(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------ the band check
def test_band_check_accepts_inside_and_rejects_outside(tmp_path: Path) -> None:
    report = SeedReport.from_values("m:f", [0, 1, 2, 3, 4], {"x": [1.0, 2.0, 3.0, 4.0, 5.0], "y": [1.0] * 5})
    path = report.save(tmp_path / "ref.json")
    inside = check_band(path, 7.0, metric="x")  # a path works as well as the object
    assert inside.inside
    assert bool(inside)
    assert (inside.low, inside.high) == report.metrics["x"].prediction
    assert inside.message.startswith("x = 7 is inside the 95% prediction band for one new run [-1.80894, 7.80894]")
    outside = check_band(report, 8.0, metric="x")
    assert not outside.inside
    assert not bool(outside)
    assert outside.message.endswith("of 5 seeds (mean 3): 0.191 above it")
    below = check_band(report, -2.5, metric="x")
    assert not below
    assert "0.691 below it" in below.message
    # the interval of the mean is for a value that is itself a mean: 7 is far outside it
    assert not check_band(report, 7.0, metric="x", band="confidence")
    assert check_band(report, 4.9, metric="x", band="confidence")
    assert check_band(report, report.metrics["x"].prediction[1], metric="x")  # bounds included
    assert not check_band(report, math.nan, metric="x")
    assert check_band(report, 1.0, metric="y")
    assert not check_band(report, 1.0 + 1e-12, metric="y")


def test_band_check_names_the_metric_it_needs() -> None:
    report = SeedReport.from_values("m:f", [0, 1], {"x": [1.0, 2.0], "y": [1.0, 3.0]})
    with pytest.raises(InputError, match=r"metrics \['x', 'y'\]: pass `metric=`"):
        check_band(report, 1.0)
    with pytest.raises(InputError, match="no metric 'z'"):
        check_band(report, 1.0, metric="z")
    with pytest.raises(ValueError, match="`band` must be"):
        check_band(report, 1.0, metric="x", band="mean")  # type: ignore[arg-type]


def test_missing_scipy_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, on_path: None) -> None:
    monkeypatch.setitem(sys.modules, "scipy", None)  # `import scipy...` raises ImportError
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    with pytest.raises(ImportError, match=r'pip install "lightning-repro\[stats\]"'):
        summarize("x", [1.0, 2.0])
    with pytest.raises(ImportError, match=r'pip install "lightning-repro\[stats\]"'):
        run_seeds("seed_targets:flaky", [1, 2], **FAST)  # before any seed runs (these would fail)
    assert summarize("x", [1.0]).mean == 1.0  # one value needs no quantile


# ------------------------------------------------------------------------------------------ run_seeds
@pytest.mark.slow
def test_run_seeds_reports_each_metric(tmp_path: Path, capsys: pytest.CaptureFixture[str], on_path: None) -> None:
    report = run_seeds("seed_targets:metrics", [0, 1, 2], out=tmp_path / "r.json", progress=True, **FAST)
    bar = capsys.readouterr().err  # the progress bar across the seeds (drawn once at the end off a terminal)
    assert "seed_targets:metrics: seed 2" in bar
    assert "3/3" in bar
    assert report.seeds == (0, 1, 2)
    assert report.metrics["a"].values == (0.0, 1.0, 2.0)
    assert report.metrics["b"].values == (1.0, 0.5, 1 / 3)
    assert report.metrics["a"].mean == 1.0
    assert report.metrics["a"].std == 1.0
    assert report.metrics["a"].t == pytest.approx(T_0975_2, rel=1e-14, abs=0)
    assert report.target == "seed_targets:metrics"
    fixed = os.environ.get("PYTHONHASHSEED", "random") != "random"
    expected = os.environ["PYTHONHASHSEED"] if fixed else "0"
    assert report.environment["env:PYTHONHASHSEED"] == expected  # the seeds' processes start with it fixed
    assert SeedReport.load(tmp_path / "r.json") == report
    only_b = run_seeds("seed_targets:metrics", [5, 4], ["b"], **FAST)
    assert list(only_b.metrics) == ["b"]
    assert only_b.metrics["b"].values == (1 / 6, 1 / 5)


@pytest.mark.slow
def test_a_failing_seed_is_reported_with_its_seed_and_the_others_go_on(tmp_path: Path, on_path: None) -> None:
    out = tmp_path / "r.json"
    with pytest.raises(SeedRunError) as caught:
        run_seeds("seed_targets:flaky", [0, 1, 2, 3], out=out, timeout=3, **FAST)
    error = caught.value
    assert error.failures == {
        1: "raised ValueError: boom at seed 1",
        2: "its process exited with code 7 before returning a result",
        3: "did not finish within 3 s; its process was killed",
    }
    message = str(error)
    assert message.startswith("3 of 4 seeds failed: seed 1: raised ValueError: boom at seed 1; seed 2: its")
    assert 'raise ValueError(f"boom at seed {seed}")' in message  # the child's traceback
    assert "about to die" in message  # the end of the dead process's output
    assert error.report is not None
    assert error.report.seeds == (0,)
    assert "The report of the others is in `error.report` and in" in message  # the API's wording (the CLI's: above)
    assert SeedReport.load(out).failures == error.failures
    with pytest.raises(SeedRunError, match=r"^1 of 2 seeds failed: seed 1: .* 1 seeds did not run\n") as stopped:
        run_seeds("seed_targets:flaky", [1, 0], stop_on_failure=True, **FAST)  # seed 0 never runs
    assert stopped.value.report is None


@pytest.mark.slow
def test_a_non_finite_result_is_kept_named_and_warned_about(tmp_path: Path, on_path: None) -> None:
    with pytest.warns(lightning_repro.ReproWarning, match="metric 'loss': seed 1 gave nan"):
        report = run_seeds("seed_targets:nan_on_one", [0, 1, 2], log_dir=tmp_path / "logs", **FAST)
    assert math.isnan(report.metrics["loss"].values[1])
    assert report.metrics["loss"].mean is None
    assert report.metrics["acc"].mean == pytest.approx(0.9)
    assert (tmp_path / "logs" / "seed-2.log").read_text() == "training seed 2\n"  # each seed's own output


@pytest.mark.slow
def test_a_missing_metric_names_the_seed_and_the_metric(on_path: None) -> None:
    with pytest.raises(InputError, match=r"seed 1: seed_targets:missing_metric returned no metric 'a' \(it returned"):
        run_seeds("seed_targets:missing_metric", [0, 1], **FAST)
    with pytest.raises(InputError, match="seed 0: seed_targets:missing_metric returned no metric 'c'"):
        run_seeds("seed_targets:missing_metric", [0, 1], ["b", "c"], **FAST)
    with pytest.raises(InputError, match="seed 4: seed_targets:not_a_dict returned float, not a dict"):
        run_seeds("seed_targets:not_a_dict", [4], **FAST)
    with pytest.raises(InputError, match="seed 0: metric 'a' of seed_targets:not_a_number is not a number: str"):
        run_seeds("seed_targets:not_a_number", [0], **FAST)
    with pytest.raises(InputError, match=r"metric 'a' of seed_targets:numeric_text is not a number: str '0\.5'"):
        run_seeds("seed_targets:numeric_text", [0], **FAST)
    # an int past float's range: it was an OverflowError out of the seed's process (a traceback, exit 1)
    with pytest.raises(InputError, match=r"metric 'a' of seed_targets:huge is not a number: int 1000"):
        run_seeds("seed_targets:huge", [0], **FAST)


@pytest.mark.slow
def test_a_metric_only_later_seeds_return_is_said_not_dropped_silently(on_path: None) -> None:
    said = r"seed 1 of seed_targets:extra_metric returned \['late'\], which seed 0"
    with pytest.warns(lightning_repro.ReproWarning, match=said):
        report = run_seeds("seed_targets:extra_metric", [0, 1], **FAST)
    assert list(report.metrics) == ["a"]
    with pytest.raises(InputError, match="seed 0: seed_targets:extra_metric returned no metric 'late'"):
        run_seeds("seed_targets:extra_metric", [0, 1], ["a", "late"], **FAST)  # named: required of every seed


@pytest.mark.slow
def test_a_missing_metric_keeps_the_report_of_the_seeds_that_ran_before(tmp_path: Path, on_path: None) -> None:
    """Seed 1 lacks metric ``a``: an ``InputError`` as before, and seed 0's report is written to ``out`` (it was
    lost: hours of training for a metric one seed did not log)."""
    out = tmp_path / "seeds.json"
    with pytest.raises(InputError, match=f"The report of the 1 seed that ran before it is in '{out}'"):
        run_seeds("seed_targets:missing_metric", [0, 1], out=out, **FAST)
    report = SeedReport.load(out)
    assert list(report.seeds) == [0]
    assert list(report.metrics["a"].values) == [1.0]
    with pytest.raises(InputError) as error:  # nothing ran before: nothing written, nothing said
        run_seeds("seed_targets:missing_metric", [0, 1], ["c"], out=tmp_path / "none.json", **FAST)
    assert "report" not in str(error.value)
    assert not (tmp_path / "none.json").exists()


def test_an_out_that_cannot_be_written_fails_before_any_seed_runs(tmp_path: Path, on_path: None) -> None:
    """Every seed ran, then ``save`` raised (a traceback, exit 1) and every result was lost; now bad input at once."""
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match=r"`out` '.*file/seeds\.json' cannot be written"):
        run_seeds("seed_targets:metrics", [0, 1], out=tmp_path / "file" / "seeds.json", **FAST)
    with pytest.raises(InputError, match="is a directory"):
        run_seeds("seed_targets:metrics", [0, 1], out=tmp_path, **FAST)


def test_bad_arguments_fail_before_any_seed_runs(on_path: None) -> None:
    with pytest.raises(ValueError, match=r"`seeds` repeats \[1\]"):
        run_seeds("seed_targets:metrics", [1, 2, 1])
    with pytest.raises(ValueError, match="`seeds` is empty"):
        run_seeds("seed_targets:metrics", [])
    with pytest.raises(ValueError, match=r"`seeds\[1\]` must be in \[0, 2\*\*32 - 1\], got -1"):
        run_seeds("seed_targets:metrics", [0, -1])
    with pytest.raises(ValueError, match="`confidence` must be in"):
        run_seeds("seed_targets:metrics", [0], confidence=95)
    with pytest.raises(TypeError, match="`metrics` must be a list"):
        run_seeds("seed_targets:metrics", [0], "a")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="cannot import 'no_such_module'"):
        run_seeds("no_such_module:train", [0])
    with pytest.raises(InputError, match="'NOT_A_FUNCTION' is a int, not a function"):
        run_seeds("seed_targets:NOT_A_FUNCTION", [0])
    with pytest.raises(TypeError, match="must be a module-level function"):
        run_seeds(lambda seed: {"a": 1.0}, [0])


# ------------------------------------------------------------------------------------------ the CLI
@pytest.mark.slow
def test_cli_seeds_prints_the_table_and_writes_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], on_path: None
) -> None:
    out = tmp_path / "r.json"
    argv = ["seeds", "seed_targets:metrics", "--seeds", "3", "--first-seed", "2", "--start-method", "forkserver"]
    assert main([*argv, "--out", str(out), "--metrics", "a", "--log-dir", str(tmp_path / "logs")]) == 0
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["seed-2.log", "seed-3.log", "seed-4.log"]
    table = capsys.readouterr().out
    assert "seed_targets:metrics over 3 seeds (2, 3, 4)" in table
    assert "95% CI of the mean" in table
    assert "│ a " in table
    assert "│ b " not in table
    assert SeedReport.load(out).metrics["a"].values == (2.0, 3.0, 4.0)
    assert main([*argv, "--json", "--confidence", "0.9"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["confidence"] == 0.9
    assert printed["metrics"]["b"]["values"] == [1 / 3, 1 / 4, 1 / 5]


@pytest.mark.slow
def test_cli_seeds_check_exits_1_when_a_new_value_is_outside_the_band(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], on_path: None
) -> None:
    reference = SeedReport.from_values("ref", [0, 1, 2, 3, 4], {"a": [1.0, 2.0, 3.0, 4.0, 5.0]})
    path = reference.save(tmp_path / "ref.json")
    common = ["seeds", "seed_targets:metrics", "--seeds", "1", "--start-method", "forkserver", "--check", str(path)]
    assert main([*common, "--first-seed", "7"]) == 0  # a = 7.0: inside [-1.81, 7.81]
    assert "inside  seed 7: a = 7 is inside the 95% prediction band" in capsys.readouterr().out
    assert main([*common, "--first-seed", "8", "--json"]) == 1  # a = 8.0: outside
    checks = json.loads(capsys.readouterr().out)["checks"]
    assert checks == [
        {"seed": 8, "metric": "a", "value": 8.0, "inside": False, "low": reference.metrics["a"].prediction[0],
         "high": reference.metrics["a"].prediction[1]}
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_module:train"], "cannot import 'no_such_module'"),
        (["seed_targets"], "TARGET must be 'module:function'"),
        (["seed_targets:NOT_A_FUNCTION"], "is a int, not a function"),
        (["seed_targets:metrics", "--seeds", "0"], "--seeds must be at least 1, got 0"),
        # a huge K is bad input before any list is built (it was an OverflowError or a MemoryError, exit 1)
        (["seed_targets:metrics", "--seeds", str(10**20)], "`--first-seed + --seeds - 1` must be in [0, 2**32 - 1]"),
        (["seed_targets:metrics", "--seeds", "2", "--first-seed", "-5"], "pick a seed in that range (for example"),
        (["seed_targets:metrics", "--out", "."], "--out .: is a directory"),  # was a traceback, a .tmp left there
        (["seed_targets:metrics", "--check", "missing.json"], "seed report 'missing.json': cannot read it"),
        pytest.param(
            ["seed_targets:missing_metric", "--seeds", "2", "--start-method", "forkserver"],
            "seed 1: seed_targets",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_cli_seeds_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], on_path: None
) -> None:
    assert main(["seeds", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-repro seeds: ")
    assert message in err
    assert err.count("\n") == 1


@pytest.mark.slow
def test_cli_seeds_exits_1_when_a_seed_fails(capsys: pytest.CaptureFixture[str], on_path: None) -> None:
    assert main(["seeds", "seed_targets:flaky", "--seeds", "2", "--start-method", "forkserver"]) == 1
    captured = capsys.readouterr()
    assert "seed 1 failed: raised ValueError: boom at seed 1" in captured.out  # under the table of seed 0
    assert "1 of 2 seeds failed: seed 1: raised ValueError" in captured.err
    assert "The report of the others is printed above" in captured.err  # not the API's `error.report`
    assert "error.report" not in captured.err


def test_stats_api_is_exported() -> None:
    for name in ("run_seeds", "check_band", "SeedReport", "BandCheck", "SeedRunError"):
        assert name in lightning_repro.__all__


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def example_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[SeedReport, Path]:
    out = tmp_path_factory.mktemp("example") / "report.json"
    saved = list(sys.path)
    sys.path[:0] = [str(ROOT)]
    try:
        return run_seeds("examples.multi_seed:train", [0, 1, 2], out=out, **FAST), out
    finally:
        sys.path[:] = saved


def _bits(report: SeedReport) -> dict[str, list[str]]:
    return {name: [x.hex() for x in m.values] for name, m in report.metrics.items()}


@pytest.mark.slow
def test_example_over_three_seeds_end_to_end(example_report: tuple[SeedReport, Path]) -> None:
    report, out = example_report
    assert report.seeds == (0, 1, 2)
    assert list(report.metrics) == ["train_loss", "val_loss", "val_acc"]
    loss = report.metrics["train_loss"]
    assert all(math.isfinite(x) for x in loss.values)
    assert len(set(loss.values)) == 3  # the seed changes the run
    assert loss.ci is not None
    assert loss.ci[0] < loss.mean < loss.ci[1]
    assert SeedReport.load(out) == report
    accuracy = report.metrics["val_acc"]
    assert accuracy.mean is not None
    assert 0.6 < accuracy.mean <= 1.0
    assert check_band(out, accuracy.values[0], metric="val_acc")  # each reference run lies in its own band


@pytest.mark.slow
def test_cli_seeds_in_a_subprocess_reproduces_each_seed_bitwise(
    example_report: tuple[SeedReport, Path], tmp_path: Path
) -> None:
    import runner

    out = tmp_path / "cli.json"
    code, stdout, stderr = runner.execute(
        ["-m", "lightning_repro", "seeds", "examples.multi_seed:train", "--seeds", "3", "--out", str(out),
         "--start-method", "forkserver"]
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    assert "examples.multi_seed:train over 3 seeds (0, 1, 2)" in stdout
    assert "train_loss" in stdout
    assert "95% CI of the mean" in stdout
    again = SeedReport.load(out)
    assert _bits(again) == _bits(example_report[0])  # each seed, run again in another process: the same bits


@pytest.mark.slow
def test_a_seed_gives_the_same_bits_with_spawn(example_report: tuple[SeedReport, Path], on_path: None) -> None:
    report = run_seeds("examples.multi_seed:train", [1])  # the default: a new interpreter for the seed
    reference = example_report[0]
    assert {name: [m.values[0].hex()] for name, m in report.metrics.items()} == {
        name: [m.values[1].hex()] for name, m in reference.metrics.items()
    }
