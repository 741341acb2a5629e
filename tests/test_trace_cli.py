"""``lightning-repro diff``: exit codes, the table, ``--json``, ``--plot`` and its missing-matplotlib message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_repro.cli.main import main
from lightning_repro.trace import TraceRecord, TraceWriter, encode_loss

JSON_KEYS = {"first_divergent_step", "last_equal_step", "field", "cause", "common_steps"}


def _write(path: Path, *, noise_from: int = 0, steps: int = 6, rank: int = 0, world: int | None = None) -> Path:
    writer = TraceWriter(path)
    writer.header(rank=rank, resumed_from_step=None, **({"world_size": world} if world else {}))
    for s in range(1, steps + 1):
        loss = 1.0 / s + (1e-3 if noise_from and s >= noise_from else 0.0)
        writer.write(TraceRecord(s, 0, s - 1, rank, f"i{s}", f"d{s}", encode_loss(loss), "s", f"p{s}"))
    writer.close()
    return path


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    return _write(tmp_path / "a.jsonl"), _write(tmp_path / "b.jsonl", noise_from=4)


def test_a_trace_with_itself_exits_0(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(pair[0]), str(pair[0])]) == 0
    out = capsys.readouterr().out
    assert "all 6 common steps agree bitwise" in out


def test_a_longer_trace_is_said_beside_the_common_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run stopped early against the complete one: they agree where both went (exit 0), and the text said only
    "all 6 common steps agree bitwise" (the JSON's ``only_b``: 3); the longer trace's steps are said now."""
    short, long = _write(tmp_path / "a.jsonl"), _write(tmp_path / "b.jsonl", steps=9)
    assert main(["diff", str(short), str(long)]) == 0
    assert "all 6 common steps agree bitwise (3 more steps only in B)" in capsys.readouterr().out


def test_a_faulty_pair_exits_1_with_the_json_keys(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(pair[0]), str(pair[1]), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report.keys() >= JSON_KEYS
    assert {k: report[k] for k in JSON_KEYS} == {
        "first_divergent_step": 4,
        "last_equal_step": 3,
        "field": "loss",
        "cause": "numerics",
        "common_steps": 6,
    }


def test_the_table_names_step_field_and_cause(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(pair[0]), str(pair[1])]) == 1
    out = capsys.readouterr().out
    assert "the traces part at step 4 (steps up to 3 agree): field 'loss' differs first, likely cause numerics" in out
    assert "differs" in out


def test_a_table_written_to_a_file_holds_whole_digests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Off a terminal rich drew 80 columns, and the records table cut each 64-digit digest to 25 digits and '…'."""
    digest = "0123456789abcdef" * 4
    for name, loss in (("a", 1.0), ("b", 2.0)):
        writer = TraceWriter(tmp_path / f"{name}.jsonl")
        writer.write(TraceRecord(1, 0, 0, 0, digest, digest, encode_loss(loss), digest, digest))
        writer.close()
    assert main(["diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 1
    out = capsys.readouterr().out
    assert out.count(digest) == 8, out  # indices, data, streams, params of A and B
    assert "…" not in out


def test_directories_are_compared_rank_by_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, noise in (("a", 0), ("b", 5)):
        (tmp_path / name).mkdir()
        _write(tmp_path / name / "trace-rank0.jsonl", rank=0)
        _write(tmp_path / name / "trace-rank1.jsonl", rank=1, noise_from=noise)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["rank"], report["first_divergent_step"]) == (1, 5)
    assert [r["first_divergent_step"] for r in report["ranks"]] == [None, 5]


def test_one_rank_s_file_of_a_multi_rank_run_says_only_that_rank_is_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``diff A/trace.jsonl B/trace.jsonl`` of 2-rank runs compared rank 0 only, and said nothing of it."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        _write(tmp_path / name / "trace.jsonl", rank=0, world=2)
        _write(tmp_path / name / "trace-rank1.jsonl", rank=1, world=2, noise_from=5 if name == "b" else 0)
    assert main(["diff", str(tmp_path / "a" / "trace.jsonl"), str(tmp_path / "b" / "trace.jsonl")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    said = "is the trace of rank 0 of a run with 2 ranks: only that rank is compared"
    assert f"note: {tmp_path / 'a' / 'trace.jsonl'} {said}" in out
    assert f"note: {tmp_path / 'b' / 'trace.jsonl'} {said}" in out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1  # the directories: every rank
    assert "only that rank" not in capsys.readouterr().out


def test_another_world_size_is_said_beside_the_data_order_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one, two = _write(tmp_path / "one.jsonl", world=1), _write(tmp_path / "two.jsonl", world=2)
    lines = two.read_text().replace('"indices":"i1"', '"indices":"other"')  # rank 0 of 2 reads other samples
    two.write_text(lines)
    assert main(["diff", str(one), str(two), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["cause"] == "data-order"
    assert any("another world size (1 and 2 ranks)" in note for note in report["notes"]), report["notes"]
    assert main(["diff", str(one), str(_write(tmp_path / "same.jsonl", world=1)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == []


@pytest.mark.parametrize("bad", ["missing", "malformed", "empty-dir"])
def test_bad_input_exits_2_with_one_line(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    target = tmp_path / bad
    if bad == "malformed":
        target.write_text(pair[0].read_text().replace('"epoch":0', '"epoch":[]', 1))
    elif bad == "empty-dir":
        target.mkdir()
    assert main(["diff", str(pair[0]), str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("lightning-repro diff: ")
    assert str(target) in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("other", ["empty", "header-only", "torn", "no-common-step"])
def test_nothing_compared_exits_2_with_one_line(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], other: str
) -> None:
    """An empty trace, one with its header only, a torn line only, or no step in common: nothing is compared, and
    that is bad input (exit 2), not agreement (it exited 0: a CI gate on `diff` passed against an empty file)."""
    target = tmp_path / f"{other}.jsonl"
    if other == "empty":
        target.write_text("")
    elif other == "header-only":
        target.write_text(pair[0].read_text().splitlines(keepends=True)[0])
    elif other == "torn":
        target.write_bytes(b"garbage")  # no newline: read as a torn last line
    else:
        lines = pair[0].read_text().splitlines(keepends=True)
        target.write_text(lines[0] + lines[-1].replace('"step":6', '"step":60', 1))
    assert main(["diff", str(pair[0]), str(target), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    said = "the traces have no step in common" if other == "no-common-step" else f"{target}: no step record"
    assert captured.err.startswith(f"lightning-repro diff: {said}, nothing to compare"), captured.err


@pytest.mark.parametrize("name", ["losses.txt", "losses", "folder"])
def test_plot_to_a_file_matplotlib_cannot_write_exits_2_with_one_line(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """An unknown extension raised matplotlib's ValueError (a traceback, exit 1); no extension or a folder wrote
    ``NAME.png`` while the line said ``NAME``."""
    target = tmp_path / name
    if name == "folder":
        target.mkdir()
    assert main(["diff", str(pair[0]), str(pair[1]), "--plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"lightning-repro diff: --plot {target}: "), err
    written = sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".jsonl")
    assert written == (["folder"] if name == "folder" else [])  # no NAME.png beside it


def test_plot_writes_a_png(pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "losses.png"
    assert main(["diff", str(pair[0]), str(pair[1]), "--plot", str(png)]) == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loss curves written to {png}" in capsys.readouterr().out


def test_plot_without_matplotlib_exits_2_with_one_line(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["diff", str(pair[0]), str(pair[1]), "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--plot needs matplotlib" in err
    assert "lightning-repro[plot]" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_python_dash_m_diff(pair: tuple[Path, Path]) -> None:
    import runner

    code, out, err = runner.execute(["-m", "lightning_repro", "diff", str(pair[0]), str(pair[1]), "--json"])
    assert code == 1, err
    assert json.loads(out)["cause"] == "numerics"


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_a_reader_gone_exits_141_quietly_not_1(pair: tuple[Path, Path], as_json: bool) -> None:
    # `lightning-repro diff A B | head`: exit 1 would read as "the traces differ" (and the pair here do not)
    import os
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write meets EPIPE, on any machine
    command = [sys.executable, "-m", "lightning_repro", "diff", str(pair[0]), str(pair[0])] + ["--json"] * as_json
    try:
        done = subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
