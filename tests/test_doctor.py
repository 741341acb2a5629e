"""``lightning-repro doctor``: the environment table, the replay that names a nondeterministic module, exit codes."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import runner
import torch

from lightning_repro import digest_tensors
from lightning_repro.cli import doctor
from lightning_repro.cli.main import main
from lightning_repro.cli.replay import load_target, replay_step

TARGETS = '''
import os
from collections import OrderedDict

import lightning.pytorch as pl
import torch
from torch import nn


class Jitter(nn.Module):
    """Noise from os.urandom: no seed reaches it."""

    def forward(self, x):
        raw = torch.frombuffer(bytearray(os.urandom(4 * x.numel())), dtype=torch.int32).reshape(x.shape)
        return x + raw.float() * 1e-12


class Model(pl.LightningModule):
    def __init__(self, noisy=False, alert=False):
        super().__init__()
        layers = [("fc", nn.Linear(4, 8))] + ([("jitter", Jitter())] if noisy else []) + [("act", nn.ReLU())]
        self.body = nn.Sequential(OrderedDict(layers))
        self.head = nn.Linear(8, 1)
        self.alert = alert

    def training_step(self, batch, batch_idx):
        if self.alert:  # what torch does in an operation without a deterministic implementation
            from torch._prims_common import alert_not_deterministic

            alert_not_deterministic("fancy_scatter")
        x, y = batch
        self.log("loss", 1.0)  # no trainer here: doctor must not trip over Lightning's warning
        return nn.functional.mse_loss(self.head(nn.functional.dropout(self.body(x), 0.5)), y)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)


def clean():
    return Model(), _batch()


def noisy():
    return Model(noisy=True), _batch()


def alert():
    return Model(alert=True), _batch()


def not_a_pair():
    return Model()


def broken():
    raise RuntimeError("no GPU\\nhere")


def module_not_lightning():
    return torch.nn.Linear(4, 1), _batch()


def exits():
    raise SystemExit(0)  # `sys.exit(0)`, or argparse's exit: doctor exited 0 with no output ("nothing wrong")


class Exiting(Model):
    def training_step(self, batch, batch_idx):
        raise SystemExit(0)


def step_exits():
    return Exiting(), _batch()
'''

GOOD_ENV = {
    "python": "3.12.0",
    "torch": "2.13.0",
    "deterministic_algorithms": "False",
    "cudnn_deterministic": "False",
    "cudnn_benchmark": "False",
    "float32_matmul_precision": "highest",
    "hash_randomization": "0",
    "env:PYTHONHASHSEED": "0",
    "cuda_available": "False",
    "num_threads": "2",
    "env:OMP_NUM_THREADS": "2",
}


@pytest.fixture
def targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``dtargets.py`` in the current directory (doctor imports TARGET from there), forgotten afterwards."""
    (tmp_path / "dtargets.py").write_text(textwrap.dedent(TARGETS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("dtargets", None)


@pytest.fixture
def good_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "collect_environment", lambda: dict(GOOD_ENV))


def _flags() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _rows(info: dict[str, str]) -> dict[str, doctor.Finding]:
    return {row.name: row for row in doctor.audit_environment(info)}


def test_injected_noise_module_is_named_first(targets: Path, good_env: None, capsys: Any) -> None:
    assert main(["doctor", "dtargets:noisy"]) == 1
    out = capsys.readouterr().out
    assert "first module whose output differs: body.jitter" in out
    assert main(["doctor", "dtargets:noisy", "--json"]) == 1
    replay = json.loads(capsys.readouterr().out)["replay"]
    assert replay["outputs"][0] == "body.jitter"
    assert "body.fc" not in replay["outputs"]  # it runs before the noise: its output is equal
    assert replay["gradients"] == ["body.fc", "head"]  # in execution order
    assert not replay["clean"]


def test_clean_model_passes(targets: Path, good_env: None, capsys: Any) -> None:
    assert main(["doctor", "dtargets:clean", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["replay"]["clean"]
    assert report["problems"] == []
    module, batch = load_target("dtargets:clean")
    weights, before = digest_tensors(module.state_dict()), torch.get_rng_state()
    flags = _flags()
    assert replay_step(module, batch).clean
    assert torch.equal(torch.get_rng_state(), before)  # the replay put the streams back
    assert digest_tensors(module.state_dict()) == weights  # and the weights
    assert _flags() == flags


def test_operation_without_deterministic_implementation_is_reported(targets: Path, good_env: None, capsys: Any) -> None:
    assert main(["doctor", "dtargets:alert", "--json"]) == 1
    replay = json.loads(capsys.readouterr().out)["replay"]
    assert replay["operations"] == ["fancy_scatter"]
    assert replay["outputs"] == []


def test_a_file_target_is_replayed_from_another_directory(
    targets: Path, good_env: None, tmp_path_factory: pytest.TempPathFactory, capsys: Any, monkeypatch: Any
) -> None:
    # as `seeds` takes it: path/to/file.py:function, the file not importable from the current directory
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    assert main(["doctor", f"{targets / 'dtargets.py'}:noisy", "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["replay"]["clean"]
    assert main(["doctor", f"{targets / 'dtargets.py'}:clean", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replay"]["clean"]
    assert main(["doctor", "no/such/file.py:clean"]) == 2
    assert "TARGET: no file 'no/such/file.py'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("dtargets", "TARGET must be 'module:function' or 'path/to/file.py:function', got 'dtargets'"),
        ("runs/last.ckpt", "got 'runs/last.ckpt'; to look at a checkpoint, run `lightning-repro inspect CKPT`"),
        ("no_such_module:f", "cannot import TARGET 'no_such_module:f': ModuleNotFoundError"),
        ("dtargets:missing", "cannot import TARGET 'dtargets:missing': AttributeError"),
        ("dtargets:not_a_pair", "must return (LightningModule, batch), got Model"),
        ("dtargets:broken", "raised RuntimeError: no GPU here"),
        ("dtargets:module_not_lightning", "must return (LightningModule, batch), got (Linear, tuple)"),
        ("dtargets:exits", "TARGET 'dtargets:exits' raised SystemExit: 0"),
        ("dtargets:step_exits", "training_step(batch, 0) of the TARGET's module raised SystemExit: 0"),
    ],
)
def test_bad_target_exits_2_with_one_line(targets: Path, target: str, message: str, capsys: Any) -> None:
    assert main(["doctor", target]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_rows_of_a_fresh_interpreter() -> None:
    rows = _rows(GOOD_ENV)
    assert rows["deterministic algos"].status == "callback"  # DeterminismCallback sets it
    assert rows["cudnn.deterministic"].status == "callback"
    assert rows["cudnn.benchmark"].status == "ok"
    assert rows["PYTHONHASHSEED"].status == "ok"
    assert rows["CUBLAS_WORKSPACE_CONFIG"].status == "ok"  # no CUDA: not needed
    assert rows["torch threads (intra-op)"].status == "ok"
    assert not [row for row in rows.values() if row.status == "problem"]


def test_rows_that_need_a_fix() -> None:
    rows = _rows(
        {
            **GOOD_ENV,
            "hash_randomization": "1",
            "env:PYTHONHASHSEED": "",
            "cuda_available": "True",
            "tf32_matmul": "True",
            "float32_matmul_precision": "high",
            "env:OMP_NUM_THREADS": "",
        }
    )
    assert rows["PYTHONHASHSEED"].status == "problem"
    assert rows["PYTHONHASHSEED"].fix.startswith("set PYTHONHASHSEED=0 before starting Python")
    assert rows["CUBLAS_WORKSPACE_CONFIG"].status == "callback"  # CUDA not started yet: the callback sets it
    assert rows["TF32 matmul"].status == "warn"
    assert rows["float32 matmul precision"].status == "warn"
    assert rows["torch threads (intra-op)"].status == "warn"
    started = _rows({**GOOD_ENV, "cuda_available": "True", "cuda_initialized": "True"})
    assert started["CUBLAS_WORKSPACE_CONFIG"].status == "problem"  # too late for the callback
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in started["CUBLAS_WORKSPACE_CONFIG"].fix


def test_table_of_this_environment(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "240")  # rich wraps the table to the terminal's width
    code = main(["doctor"])
    out = capsys.readouterr().out
    for name in ("torch", "lightning", "torchmetrics", "cpu", "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "cudnn"):
        assert name in out
    problems = [r for r in doctor.audit_environment(doctor.collect_environment()) if r.status == "problem"]
    assert code == (1 if problems else 0)


@pytest.mark.slow
def test_doctor_in_a_fresh_interpreter(targets: Path) -> None:
    code, out, err = runner.execute(["-m", "lightning_repro", "doctor", "dtargets:noisy", "--json"])
    assert code == 1, err[-2000:]
    report = json.loads(out)
    assert report["replay"]["outputs"][0] == "body.jitter"
    rows = {row["name"]: row for row in report["environment"]}
    assert rows["PYTHONHASHSEED"]["status"] == "ok"  # the runner starts Python with PYTHONHASHSEED=0
    assert report["problems"] == ["model replay"]
