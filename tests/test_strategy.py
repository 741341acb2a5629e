"""ReproDDPStrategy in process: registration, environment export, per-rank seeding and its log."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, StrategyRegistry

from lightning_repro import DeterminismCallback, ReproDDPStrategy, register_strategy


def test_registered_by_name_and_safe_to_register_again() -> None:
    assert "ddp_repro" in StrategyRegistry
    register_strategy()
    register_strategy()
    trainer = pl.Trainer(strategy="ddp_repro", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, ReproDDPStrategy)
    assert isinstance(trainer.strategy, DDPStrategy)


def test_the_strategy_pickles_as_lightnings() -> None:
    """``strategy="ddp_repro"``'s launcher held a closure (``Can't pickle local object``); Lightning's ``"ddp"`` and
    its launcher pickle."""
    import pickle

    options: dict[str, Any] = {"accelerator": "cpu", "devices": 2, "logger": False, "enable_progress_bar": False}
    for name in ("ddp", "ddp_repro"):
        strategy = pl.Trainer(strategy=name, **options).strategy
        copy = pickle.loads(pickle.dumps(strategy))
        assert type(copy) is type(strategy)
        launch = copy.launcher.launch
        if name == "ddp_repro":  # the copy's wrapper calls the launcher's own launch, not itself
            assert launch.args[0].func is type(copy.launcher).launch
            assert launch.args[0].args == (copy.launcher,)


def test_ddp_kwargs_pass_through() -> None:
    strategy = ReproDDPStrategy(find_unused_parameters=True, process_group_backend="gloo")
    assert strategy._ddp_kwargs["find_unused_parameters"] is True
    assert strategy.process_group_backend == "gloo"


def _launch_capturing_environment(monkeypatch: pytest.MonkeyPatch, seed: int) -> tuple[list[str | None], Any]:
    """Run the strategy's launcher with the start of the ranks replaced by a probe of ``os.environ``."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    trainer = pl.Trainer(
        strategy="ddp_repro",
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        callbacks=[DeterminismCallback(seed=seed)],
    )
    launcher = trainer.strategy.launcher
    assert launcher is not None
    seen: list[str | None] = []
    monkeypatch.setattr(launcher, "_call_children_scripts", lambda: seen.append(os.environ.get("PYTHONHASHSEED")))
    monkeypatch.setattr(subprocess_script, "_launch_process_observer", lambda procs: None)
    monkeypatch.setattr(subprocess_script, "_set_num_threads_if_needed", lambda num_processes: None)
    result = launcher.launch(lambda: os.environ.get("PYTHONHASHSEED"), trainer=trainer)
    return seen, result


def test_environment_exported_only_while_the_ranks_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    ReproDDPStrategy()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # torch needs it in this process too
    assert "PYTHONHASHSEED" not in os.environ
    seen, in_rank0 = _launch_capturing_environment(monkeypatch, seed=31)
    assert seen == ["31"]  # the launcher copies os.environ into the ranks it starts
    assert in_rank0 == "31"  # and rank 0's spawn/forkserver workers get it during the run
    assert "PYTHONHASHSEED" not in os.environ  # gone again when the launch returns
    assert "PL_GLOBAL_SEED" not in os.environ
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    seen, _ = _launch_capturing_environment(monkeypatch, seed=31)
    assert seen == ["0"]  # a value the user set is kept: every rank inherits it
    assert os.environ["PYTHONHASHSEED"] == "0"


def _fake_trainer(rank: int, world_size: int) -> Any:
    return SimpleNamespace(global_rank=rank, world_size=world_size)


def test_each_rank_gets_its_own_process_streams(caplog: pytest.LogCaptureFixture) -> None:
    callback = DeterminismCallback(seed=8)
    draws = []
    with caplog.at_level(logging.INFO, logger="lightning_repro"):
        for rank in (0, 1, 0):
            callback.seed_rank(_fake_trainer(rank, 2))
            draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[2])  # a function of (seed, rank)
    assert not torch.equal(draws[0], draws[1])
    assert "[rank: 1] process streams (python, numpy, torch, CUDA) seeded from (seed=8, rank=1)" in caplog.text
    before = torch.get_rng_state()
    callback.seed_rank(_fake_trainer(0, 1))  # one process: nothing to do
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(
    ("strategy", "advice"),
    [
        (DDPStrategy, "`strategy='ddp_repro'` (ReproDDPStrategy)"),
        (FSDPStrategy, "`strategy='fsdp_repro'` (ReproFSDPStrategy)"),
        (ModelParallelStrategy, "`strategy='model_parallel_repro'` (ReproModelParallelStrategy)"),
    ],
)
def test_the_unseeded_ranks_warning_names_the_strategy_for_the_user_s(
    strategy: type, advice: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a FSDP2 model under ddp_repro gets no device mesh: the advice is the sharded strategy for a sharded one
    from lightning_repro import ReproWarning

    callback = DeterminismCallback(seed=8)
    trainer = SimpleNamespace(world_size=2, strategy=strategy(), global_rank=0)
    monkeypatch.setattr(callback._run_manifest, "publish", lambda trainer: None)
    with pytest.warns(ReproWarning, match="every rank keeps the same process streams") as said:
        callback.on_fit_start(trainer, None)  # type: ignore[arg-type]
    assert f"Use {advice} for rank-aware seeding." in str(said[0].message)


def test_on_topology_change_is_checked() -> None:
    with pytest.raises(ValueError, match="`on_topology_change` must be 'error' or 'reseed', got 'ignore'"):
        DeterminismCallback(seed=1, on_topology_change="ignore")  # type: ignore[arg-type]
