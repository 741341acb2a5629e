"""Seeding only the process streams a sample draws from (``lightning_repro.data.usage``) is exact.

Reference: the same loader with every stream seeded before every sample (the mask ``ALL``, which is the path
of a dataset drawing from all three streams, or of ``LIGHTNING_REPRO_*_RAW=0``). Compared bit for bit: every
sample of two epochs in process, and the trained weights (SHA-256) in fresh processes with 0 and 2 workers and
after a hard kill in the middle of an epoch.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import runner
import torch
from helpers import Counter, prepare
from torch.utils.data import DataLoader, Dataset

from lightning_repro.data import fastrng as _fastrng
from lightning_repro.data import usage as _usage
from lightning_repro.rng import capture_process_streams, digest_process_streams


class _Recording(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 84) -> None:
        self.n = n
        self.loads: list[int] = []

    def __len__(self) -> int:
        return self.n


class SparseNumpy(_Recording):
    """torch on every sample, numpy only on every 7th index (a cached gaussian included)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loads.append(i)
        extra = float(np.random.randn()) if i % 7 == 0 else 0.0
        return torch.cat([torch.rand(2, dtype=torch.float64), torch.tensor([float(i), extra], dtype=torch.float64)])


class LatePython(_Recording):
    """torch on every sample; python ``random`` from index 50 on: the set of streams grows late."""

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loads.append(i)
        extra = random.gauss(0, 1) if i >= 50 else 0.0
        return torch.cat([torch.rand(2, dtype=torch.float64), torch.tensor([float(i), extra], dtype=torch.float64)])


class Nothing(_Recording):
    """Draws from no stream at all."""

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loads.append(i)
        return torch.tensor([float(i)])


def _two_epochs(dataset: _Recording, *, seed_all: bool, shuffle: bool = True) -> list[bytes]:
    counter = Counter()
    loader = prepare(DataLoader(dataset, batch_size=6, shuffle=shuffle), counter)
    if seed_all:
        loader.dataset._used = _usage.ALL
    batches = []
    for epoch in range(2):
        counter.value = epoch
        batches += [batch.numpy().tobytes() for batch in loader]
    return batches


@pytest.fixture(autouse=True)
def _raw_layouts_found() -> None:
    assert _fastrng.PYTHON_RAW is not None
    assert _fastrng.NUMPY_RAW is not None


def test_a_stream_drawn_on_some_samples_only_is_seeded_exactly() -> None:
    np.random.seed(5)
    np.random.randn()  # the main process's numpy holds a cached gaussian: it must neither leak in nor be lost
    random.seed(6)
    before = digest_process_streams(capture_process_streams())
    dataset = SparseNumpy()
    learned = _two_epochs(dataset, seed_all=False)
    assert digest_process_streams(capture_process_streams()) == before  # loading never shifts the process streams
    assert _two_epochs(SparseNumpy(), seed_all=True) == learned


def test_the_learned_streams_are_only_those_drawn_from() -> None:
    loader = prepare(DataLoader(SparseNumpy(), batch_size=6, shuffle=True))
    assert loader.dataset._used == _usage.UNKNOWN
    list(loader)
    assert loader.dataset._used == _usage.NUMPY  # python never drawn from: never seeded
    loader = prepare(DataLoader(Nothing(), batch_size=6))
    list(loader)
    assert loader.dataset._used == 0  # only torch is seeded


def test_a_stream_first_drawn_late_is_seeded_exactly() -> None:
    dataset = LatePython()
    learned = _two_epochs(dataset, seed_all=False, shuffle=False)
    # index 50 drew from python while it was armed: it was loaded again with python seeded, and only it
    assert dataset.loads.count(50) == 3
    assert dataset.loads.count(49) == 2
    assert _two_epochs(LatePython(), seed_all=True, shuffle=False) == learned


def test_a_stream_that_cannot_be_armed_is_always_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_usage, "_py_index", None)  # as without python's raw layout
    loader = prepare(DataLoader(Nothing(), batch_size=6))
    list(loader)
    assert loader.dataset._used == _usage.PYTHON
    monkeypatch.setattr(_usage, "_np_pos", None)
    assert _usage.initial_usage() == _usage.ALL


@pytest.mark.parametrize("raw", [True, False], ids=["raw-copy", "public-api"])
def test_python_capture_and_restore_round_trip(raw: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fastrng, "NATIVE", None)  # the kernel's capture: tests/test_seedkernel.py
    if not raw:
        monkeypatch.setattr(_fastrng, "PYTHON_RAW", None)
    random.seed(11)
    random.gauss(0, 1)  # a cached gaussian
    saved = _fastrng.capture_fast()
    assert (type(saved[0][0]) is bytes) is raw
    expected = [random.random() for _ in range(700)] + [random.gauss(0, 1)]
    _fastrng.restore_fast(saved)
    assert [random.random() for _ in range(700)] + [random.gauss(0, 1)] == expected


def test_a_bad_python_raw_switch_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"`LIGHTNING_REPRO_PYTHON_RAW` must be 1 or 0.*got 'maybe'"):
        _fastrng.numpy_raw_wanted("maybe", _fastrng.PYTHON_RAW_ENV)


# ------------------------------------------------------------------ end to end, fresh processes
_ALL_SEEDED = {_fastrng.PYTHON_RAW_ENV: "0", _fastrng.NUMPY_RAW_ENV: "0"}  # nothing can be armed: all seeded


@pytest.mark.slow
def test_trained_weights_match_seeding_every_stream(tmp_path: Path) -> None:
    cfg: dict[str, Any] = {"dataset": "sparse_numpy", "max_epochs": 2, "val": "off"}
    reference = runner.run({**cfg, "out": str(tmp_path / "all-seeded")}, env=_ALL_SEEDED)
    learned = runner.run({**cfg, "out": str(tmp_path / "learned")})
    workers = runner.run({**cfg, "num_workers": 2, "out": str(tmp_path / "workers")})
    assert learned["params"] == reference["params"]
    assert workers["params"] == reference["params"]
    resumed = runner.killed_then_resumed(cfg, tmp_path)
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]


def test_with_workers_the_main_process_loads_no_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``num_workers > 0`` every sample is seeded and loaded in a worker: the main process only slices indices."""
    import os

    from lightning_repro.data import keyed

    log = tmp_path / "loads"
    original = keyed.load_samples

    def recording(dataset: Any, indices: Any, seeds: Any, used: int) -> Any:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {len(indices)}\n")
        return original(dataset, indices, seeds, used)

    monkeypatch.setattr(keyed, "load_samples", recording)  # the workers are forked: they inherit it
    loader = prepare(DataLoader(SparseNumpy(), batch_size=6, shuffle=True, num_workers=2))
    batches = [batch.numpy().tobytes() for batch in loader]
    calls = [line.split() for line in log.read_text().splitlines()]
    assert sum(int(n) for _, n in calls) == len(loader.dataset)  # every sample, once
    assert str(os.getpid()) not in {pid for pid, _ in calls}
    assert batches == _two_epochs(SparseNumpy(), seed_all=True)[: len(batches)]  # and exactly the seeded values
