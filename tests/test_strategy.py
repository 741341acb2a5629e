"""ReproDDPStrategy in process: registration, environment export, per-rank seeding and its log."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_repro import DeterminismCallback, ReproDDPStrategy, register_strategy


def test_registered_by_name_and_safe_to_register_again() -> None:
    assert "ddp_repro" in StrategyRegistry
    register_strategy()
    register_strategy()
    trainer = pl.Trainer(strategy="ddp_repro", accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, ReproDDPStrategy)
    assert isinstance(trainer.strategy, DDPStrategy)


def test_ddp_kwargs_pass_through() -> None:
    strategy = ReproDDPStrategy(find_unused_parameters=True, process_group_backend="gloo")
    assert strategy._ddp_kwargs["find_unused_parameters"] is True
    assert strategy.process_group_backend == "gloo"


def test_environment_exported_for_child_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("PL_GLOBAL_SEED", "31")
    ReproDDPStrategy()
    assert os.environ["PYTHONHASHSEED"] == "31"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    ReproDDPStrategy()
    assert os.environ["PYTHONHASHSEED"] == "0"  # a value the user set is kept: every rank inherits it


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


def test_on_topology_change_is_checked() -> None:
    with pytest.raises(ValueError, match="`on_topology_change` must be 'error' or 'reseed', got 'ignore'"):
        DeterminismCallback(seed=1, on_topology_change="ignore")  # type: ignore[arg-type]
