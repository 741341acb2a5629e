"""Sample-keyed streams beyond the global ones: a collate_fn without auto-collation, and datasets' own generators."""

from __future__ import annotations

import random
from typing import Any

import helpers
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_repro import DeterminismCallback, capture_process_streams, digest_tensors
from lightning_repro.rng import digest_process_streams

Counter = helpers.Counter
_prepare = helpers.prepare


class Plain(Dataset):  # type: ignore[type-arg]
    """Draws from the global streams, like most datasets."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(torch.rand(())), float(np.random.rand()), random.random()])


def random_collate(sample: torch.Tensor) -> torch.Tensor:
    """A collate_fn that augments: draws from torch, numpy and python."""
    noise = torch.tensor([0.0, float(torch.rand(())), float(np.random.rand()), random.random()])
    return sample + noise


def identity_collate(sample: torch.Tensor) -> torch.Tensor:
    return sample


def _rows(loader: DataLoader[Any]) -> list[tuple[float, ...]]:
    return [tuple(float(v) for v in t) for t in loader]


# ------------------------------------------------------------------ item 4: batch_size=None with a random collate_fn
def test_random_collate_without_auto_collation_does_not_depend_on_workers() -> None:
    in_main = _rows(_prepare(DataLoader(Plain(), batch_size=None, shuffle=True, collate_fn=random_collate)))
    in_workers = _rows(
        _prepare(DataLoader(Plain(), batch_size=None, shuffle=True, collate_fn=random_collate, num_workers=2))
    )
    assert in_workers == in_main
    assert len({row[1] for row in in_main}) == len(in_main)  # every sample's collate drew its own numbers


def test_random_collate_without_auto_collation_does_not_move_the_process_streams() -> None:
    loader = _prepare(DataLoader(Plain(), batch_size=None, shuffle=True, collate_fn=random_collate))
    before = digest_process_streams(capture_process_streams())
    rows = _rows(loader)
    assert len(rows) == 24
    assert digest_process_streams(capture_process_streams()) == before


def test_collate_that_draws_nothing_keeps_the_samples() -> None:
    default = _rows(_prepare(DataLoader(Plain(), batch_size=None, shuffle=True)))
    custom = _rows(_prepare(DataLoader(Plain(), batch_size=None, shuffle=True, collate_fn=identity_collate)))
    assert custom == default


# ------------------------------------------------------------------ item 3: a dataset that holds its own generator
class Compose:
    """Like torchvision's: a list of transforms."""

    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms

    def __call__(self, x: float) -> float:
        for t in self.transforms:
            x = t(x)
        return x


class PyJitter:
    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __call__(self, x: float) -> float:
        return x + self.rng.random()


class NpJitter:
    def __init__(self) -> None:
        self.rs = np.random.RandomState(0)

    def __call__(self, x: float) -> float:
        return x + float(self.rs.randn())  # randn caches a gaussian: re-seeding must clear it


class TorchJitter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: float) -> float:
        return x + float(torch.rand((), generator=self.gen))


class MyRandom(random.Random):
    pass


class Own(Dataset):  # type: ignore[type-arg]
    """Holds its own generators: directly, and inside transforms (a Compose list, an nn.Module)."""

    def __init__(self, kind: str, n: int = 24) -> None:
        self.n = n
        self.kind = kind
        if kind == "numpy-generator":
            self.rng: Any = np.random.default_rng(0)
        elif kind == "bit-generator":
            self.rng = np.random.Generator(np.random.MT19937(0))
        elif kind == "philox":
            self.rng = np.random.Generator(np.random.Philox(0))
        elif kind == "transforms":
            self.transform = Compose([PyJitter(), NpJitter()])
            self.module = torch.nn.Sequential(TorchJitter())
        elif kind == "randomstate-pcg":
            self.rng = np.random.RandomState(np.random.PCG64(0))
        elif kind == "bare-bit-generator":
            self.bits = np.random.SFC64(0)
        elif kind == "random-subclass":
            self.rng = MyRandom(0)

    def __len__(self) -> int:
        return self.n

    def draw(self) -> float:
        if self.kind == "transforms":
            return float(self.module(self.transform(0.0)))
        if self.kind == "randomstate-pcg":
            return float(self.rng.randn())
        if self.kind == "bare-bit-generator":
            return float(np.random.Generator(self.bits).random())
        return float(self.rng.random())

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), self.draw(), float(torch.rand(())), 0.0], dtype=torch.float64)


class OwnBatched(Own):
    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [torch.tensor([float(i), self.draw(), 0.0, 0.0], dtype=torch.float64) for i in indices]


def _samples(loader: DataLoader[Any]) -> dict[int, tuple[float, ...]]:
    return {int(row[0]): tuple(float(v) for v in row[1:]) for batch in loader for row in batch.reshape(-1, 4)}


KINDS = [
    "numpy-generator",
    "bit-generator",
    "philox",
    "transforms",
    "randomstate-pcg",
    "bare-bit-generator",
    "random-subclass",
]


@pytest.mark.parametrize("kind", KINDS)
def test_own_generators_do_not_depend_on_workers(kind: str) -> None:
    in_main = _samples(_prepare(DataLoader(Own(kind), batch_size=4, shuffle=True)))
    in_workers = _samples(_prepare(DataLoader(Own(kind), batch_size=4, shuffle=True, num_workers=2)))
    assert in_workers == in_main
    assert len({v[0] for v in in_main.values()}) == len(in_main)  # each sample drew its own number
    no_auto = {
        int(t[0]): tuple(float(v) for v in t[1:])
        for t in _prepare(DataLoader(Own(kind), batch_size=None, shuffle=True, num_workers=2))
    }
    assert no_auto == in_main  # keyed by the sample alone, whatever the batching


def test_own_generators_in_batched_getitems_do_not_depend_on_workers() -> None:
    in_main = _samples(_prepare(DataLoader(OwnBatched("numpy-generator"), batch_size=4, shuffle=True)))
    in_workers = _samples(
        _prepare(DataLoader(OwnBatched("numpy-generator"), batch_size=4, shuffle=True, num_workers=2))
    )
    assert in_workers == in_main


@pytest.mark.parametrize("kind", ["numpy-generator", "transforms"])
def test_own_generators_resume_mid_epoch(kind: str) -> None:
    full = _samples(_prepare(DataLoader(Own(kind), batch_size=4, shuffle=True)))
    loader = _prepare(DataLoader(Own(kind), batch_size=4, shuffle=True))
    loader.batch_sampler.resume_at(0, 0, 3)  # type: ignore[union-attr]
    rest = _samples(loader)
    assert len(rest) == 24 - 12
    assert all(full[i] == v for i, v in rest.items())


def test_own_generators_differ_between_epochs() -> None:
    counter = Counter(0)
    loader = _prepare(DataLoader(Own("numpy-generator"), batch_size=4), counter)
    epoch0 = _samples(loader)
    counter.value = 1
    epoch1 = _samples(loader)
    assert all(epoch0[i][0] != epoch1[i][0] for i in epoch0)


class TwinGenerators(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.a = np.random.default_rng(0)
        self.b = np.random.default_rng(0)
        self.c = random.Random(0)
        self.d = random.Random(0)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), self.a.random(), self.b.random(), self.c.random() - self.d.random()])


def test_two_generators_never_share_a_stream() -> None:
    samples = _samples(_prepare(DataLoader(TwinGenerators(), batch_size=4)))
    assert all(a != b and diff != 0.0 for a, b, diff in samples.values())


def test_main_process_loading_leaves_the_users_generators_as_found() -> None:
    dataset = Own("transforms")
    jitter, np_jitter = dataset.transform.transforms
    torch_jitter = dataset.module[0]
    np_jitter.rs.randn()  # a cached gaussian in the user's state
    before = (jitter.rng.getstate(), repr(np_jitter.rs.get_state()), torch_jitter.gen.get_state().tolist())
    process = digest_process_streams(capture_process_streams())
    assert len(_samples(_prepare(DataLoader(dataset, batch_size=4, shuffle=True)))) == 24
    assert (jitter.rng.getstate(), repr(np_jitter.rs.get_state()), torch_jitter.gen.get_state().tolist()) == before
    assert digest_process_streams(capture_process_streams()) == process


def test_generators_are_found_with_their_paths() -> None:
    from torch.utils.data import Subset

    from lightning_repro.data.generators import find_generators

    dataset = Own("transforms")
    dataset.me = dataset  # type: ignore[attr-defined]  # cycles are followed once
    dataset.transform.parent = dataset  # type: ignore[attr-defined]
    dataset.global_rng = random._inst  # type: ignore[attr-defined]  # the global stream: keyed already
    dataset.np_module = np.random  # type: ignore[attr-defined]
    found, unkeyable = find_generators(Subset(dataset, [0, 1]))
    assert sorted(g.path for g in found) == [
        "dataset.module.0.gen",
        "dataset.transform.transforms[0].rng",
        "dataset.transform.transforms[1].rs",
    ]
    assert unkeyable == []
    assert find_generators(Plain()) == ([], [])


class FancyGenerator:
    """Looks like a generator; lightning-repro does not know its type."""

    def __init__(self) -> None:
        self.counter = 0

    def manual_seed(self, seed: int) -> None:
        self.counter = seed


class WrapsTorch(FancyGenerator):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.Generator()  # keyed: no warning for the wrapper


class Unkeyable(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.system = random.SystemRandom()
        self.fancy = FancyGenerator()
        self.wrapped = WrapsTorch()


def test_generators_that_cannot_be_keyed_are_warned_once_by_path() -> None:
    import warnings

    from lightning_repro import NotExactWarning
    from lightning_repro._warn import WarningCache

    cache = WarningCache()  # what the callback holds: one per run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = _prepare(DataLoader(Unkeyable(), batch_size=4), warning_cache=cache)
        _prepare(DataLoader(Unkeyable(), batch_size=4), warning_cache=cache)  # the same causes: no second warning
    messages = sorted(str(w.message) for w in caught if issubclass(w.category, NotExactWarning))
    assert len(messages) == 2
    assert messages[0].startswith("Unkeyable.fancy looks like a random generator")
    assert "FancyGenerator is not a generator lightning-repro knows" in messages[0]
    assert messages[1].startswith("Unkeyable.system looks like a random generator")
    assert "SystemRandom" in messages[1]
    assert [g.path for g in loader.dataset._own] == ["wrapped.inner"]


def test_found_generators_survive_pickling_to_workers() -> None:
    """Spawned workers unpickle the keyed dataset: the found generators must be the unpickled dataset's own."""
    import pickle

    loader = _prepare(DataLoader(Own("transforms"), batch_size=4))
    copy = pickle.loads(pickle.dumps(loader.dataset))
    assert [g.path for g in copy._own] == [g.path for g in loader.dataset._own]
    inner = copy.dataset
    assert {id(g.obj) for g in copy._own} == {
        id(inner.transform.transforms[0].rng),
        id(inner.transform.transforms[1].rs),
        id(inner.module[0].gen),
    }


class NoisyVectors(Dataset):  # type: ignore[type-arg]
    """Vectors augmented by a numpy Generator the dataset holds: what issue 7 reported."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + float(self.rng.normal()), self.y[i]


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_digest(num_workers: int) -> str:
    callback = DeterminismCallback(seed=3)
    model = TinyModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[callback],
    )
    trainer.fit(model, DataLoader(NoisyVectors(), batch_size=4, shuffle=True, num_workers=num_workers))
    return digest_tensors(dict(model.named_parameters()))


def test_fit_with_a_dataset_holding_its_generator_does_not_depend_on_workers() -> None:
    assert _fit_digest(2) == _fit_digest(0)
