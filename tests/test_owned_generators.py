"""Generators the LightningModule and the user's callbacks hold: kept in the checkpoint entry, given back on resume.

Lightning's checkpoint holds no generator's state: a module drawing from ``self.rng = np.random.default_rng(0)``
resumed with the generator's construction state again and said exact. In one process: the uninterrupted run saves a
checkpoint in the middle of epoch 1 and a new Trainer resumes from it; weights and every draw are compared.
"""

from __future__ import annotations

import logging
import random
import warnings
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback, NotExactWarning, digest_tensors
from lightning_repro._warn import RESUME_LOGGER
from lightning_repro.checkpoint.owned import capture_owned, find_owned, restore_owned

SAVE_AT = (1, 3)


def _generators() -> dict[str, Any]:
    return {
        "python": random.Random(0),
        "pcg64": np.random.default_rng(0),
        "random_state": np.random.RandomState(0),
        "mt19937": np.random.Generator(np.random.MT19937(0)),
        "philox_bits": np.random.Philox(0),
        "torch": torch.Generator().manual_seed(0),
    }


def _draw(name: str, gen: Any) -> float:
    if name == "python":
        return gen.gauss(0.0, 1.0)  # python's cached second gaussian is part of its state
    if name == "random_state":
        return float(gen.standard_normal())  # so is RandomState's
    if name == "philox_bits":
        return float(gen.random_raw()) / 2**64
    if name == "torch":
        return float(torch.rand((), generator=gen))
    return float(gen.standard_normal())


class Noise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(1)  # in a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.01 * torch.randn(x.shape, generator=self.gen)


class OwnDraws(helpers.SmallRegressor):
    def __init__(self, kinds: tuple[str, ...] = tuple(_generators())) -> None:
        super().__init__()
        self.kinds = kinds
        self.gens = _generators()  # a dict attribute
        self.extra = [random.Random(5)]  # a list attribute
        self.noise = Noise()
        self.draws: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        draws = [_draw(kind, self.gens[kind]) for kind in self.kinds] + [self.extra[0].random()]
        self.draws += draws
        x = self.noise(x) * (1.0 + 0.01 * sum(draws))
        return nn.functional.mse_loss(self.net(x), y)


class Jitter(Callback):
    """A user's callback with a generator of its own, drawing at every batch end."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(7)
        self.seen: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.append(float(self.rng.random()))


class SaveAt(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, args[-1]) == SAVE_AT:
            trainer.save_checkpoint(self.path)


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)


def _fit(model: OwnDraws, ckpt: Path, *, resume: bool) -> tuple[str, list[float], list[float]]:
    jitter = Jitter()
    callbacks: list[Callback] = [DeterminismCallback(seed=3), jitter]
    if not resume:
        callbacks.append(SaveAt(ckpt))
    helpers.fast_trainer(callbacks, max_epochs=2).fit(model, _loader(), ckpt_path=ckpt if resume else None)
    return digest_tensors(dict(model.state_dict())), model.draws, jitter.seen


def test_the_module_and_callback_generators_resume_bitwise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = tmp_path / "mid.ckpt"
    digest, draws, seen = _fit(OwnDraws(), ckpt, resume=False)
    entry = torch.load(ckpt, weights_only=True)["callbacks"]["DeterminismCallback"]  # plain values and tensors
    paths = sorted(entry["ranks"][0]["generators"])
    assert paths == sorted(
        [f"module.gens[{k!r}]" for k in _generators()] + ["module.extra[0]", "module.noise.gen", "callback[Jitter].rng"]
    )
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(OwnDraws(), ckpt, resume=True)
    assert not [w for w in caught if issubclass(w.category, NotExactWarning)]
    assert resumed[0] == digest
    per_step = len(_generators()) + 1
    assert resumed[1] == draws[-len(resumed[1]) :]
    assert len(resumed[1]) == per_step * 4  # the 4 batches of epoch 1 after the checkpoint
    assert resumed[2] == seen[-4:]
    [line] = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert ": exact" in line


def test_a_generator_the_resumed_module_does_not_hold_is_not_exact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "mid.ckpt"
    _fit(OwnDraws(), ckpt, resume=False)
    model = OwnDraws(kinds=("python",))
    del model.gens["pcg64"]
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), pytest.warns(NotExactWarning, match="pcg64"):
        _fit(model, ckpt, resume=True)
    [line] = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert ": NOT exact: " in line


def test_a_module_without_generators_writes_no_key(tmp_path: Path) -> None:
    ckpt = tmp_path / "plain.ckpt"

    class Plain(helpers.SmallRegressor):
        pass

    callbacks = [DeterminismCallback(seed=3), SaveAt(ckpt)]
    helpers.fast_trainer(callbacks, max_epochs=2).fit(Plain(), _loader())
    entry = torch.load(ckpt, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert "generators" not in entry["ranks"][0]


@pytest.mark.parametrize("kind", list(_generators()))
def test_capture_and_restore_round_trip_every_kind(kind: str) -> None:
    holder = nn.Module()
    holder.gen = _generators()[kind]
    found = find_owned(holder, [])
    assert list(found) == ["module.gen"]
    _draw(kind, holder.gen)  # a state past the seed (python and RandomState: a cached gaussian now)
    saved = capture_owned(found)
    expected = [_draw(kind, holder.gen) for _ in range(3)]
    fresh = nn.Module()
    fresh.gen = _generators()[kind]
    assert restore_owned(find_owned(fresh, []), saved) == []
    assert [_draw(kind, fresh.gen) for _ in range(3)] == expected


def test_global_and_loader_generators_are_left_out() -> None:
    holder = nn.Module()
    holder.streams = [random._inst, np.random.mtrand._rand, torch.default_generator]  # type: ignore[attr-defined]
    holder.loader_gen = torch.Generator()
    loader = DataLoader(list(range(4)), shuffle=True, generator=holder.loader_gen)
    assert find_owned(holder, [], [loader]) == {}


def test_a_state_that_does_not_fit_is_reported_not_raised() -> None:
    """A generator of another kind, or a bit generator of another type, at a saved path: named, nothing raised."""
    holder = nn.Module()
    holder.a, holder.b, holder.c = random.Random(0), np.random.default_rng(0), torch.Generator().manual_seed(5)
    saved = capture_owned(find_owned(holder, []))
    other = nn.Module()
    other.a, other.b, other.c = torch.Generator(), np.random.Generator(np.random.Philox(0)), torch.Generator()
    lost = restore_owned(find_owned(other, []), saved)
    assert [entry.split(" ")[0].rstrip(":") for entry in lost] == ["module.a", "module.b"]
    assert "is a Generator now, the checkpoint saved a python generator" in lost[0]
    assert torch.equal(other.c.get_state(), holder.c.get_state())  # the one that fits is put back
