"""Loaders as users write them: reused across calls and trainers, predicted on, given back untouched."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler, TensorDataset

from lightning_repro import DeterminismCallback, ReproWarning, digest_tensors


class Indexed(TensorDataset):
    """x, y and the sample's index (so a step can see which samples it got)."""

    def __init__(self, n: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        super().__init__(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g), torch.arange(n))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        self.seen: list[list[int]] = []  # sample indices of each training batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen.append(index.tolist())
        return nn.functional.mse_loss(self.net(x), y) + torch.rand(()) * 1e-3

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val", nn.functional.mse_loss(self.net(x), y) + torch.rand(()))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return batch[2]  # the indices of the samples the batch holds

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.batch_indices: list[Any] = []
        self.predicted: list[list[int]] = []

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        self.batch_indices.append(batch_indices)
        self.predicted.append(prediction.tolist())


class Data(pl.LightningDataModule):
    """Builds its loaders in the hooks, as a datamodule usually does (Lightning records their init args)."""

    def __init__(self) -> None:
        super().__init__()
        self.dataset = Indexed()

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=4)

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=2)


def _trainer(*callbacks: pl.Callback, **kwargs: Any) -> pl.Trainer:
    return helpers.fast_trainer(callbacks, **kwargs)


def _digest(model: nn.Module) -> str:
    return digest_tensors(dict(model.state_dict()))


def _fit(train: Any, val: Any = None, *, seed: int = 3, max_epochs: int = 2, **kwargs: Any) -> Tiny:
    callback = DeterminismCallback(seed=seed)
    model = Tiny()
    _trainer(callback, max_epochs=max_epochs, **kwargs).fit(model, train, val)
    return model


def _predict(loader: DataLoader[Any], callback: DeterminismCallback | None) -> Writer:
    writer = Writer()
    trainer = _trainer(*([callback] if callback else []), writer)
    trainer.predict(Tiny(), loader, return_predictions=False)
    return writer


@pytest.mark.parametrize("before", ["fit", "validate", "test"])
def test_predict_after_another_call_with_the_same_loader(before: str) -> None:
    expected = _predict(DataLoader(Indexed(6), batch_size=2), None).batch_indices  # plain Lightning
    assert expected == [[0, 1], [2, 3], [4, 5]]
    loader = DataLoader(Indexed(6), batch_size=2)
    callback = DeterminismCallback(seed=3)
    model = Tiny()
    trainer = _trainer(callback, max_epochs=1)
    getattr(trainer, before)(model, loader)
    writer = Writer()
    trainer = _trainer(callback, writer)
    callback._warning_cache.clear()  # what the fit warned: predict must not warn (again)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.predict(model, loader, return_predictions=False)
    # predict never resumes: nothing of ours to warn about, and Lightning finds its index recorder
    assert [str(w.message) for w in caught if issubclass(w.category, ReproWarning)] == []
    assert [str(w.message) for w in caught if "batch indices" in str(w.message)] == []
    assert writer.batch_indices == expected
    assert all(type(indices) is list for indices in writer.batch_indices)
    assert writer.predicted == expected  # the indices name the samples each batch really held


def test_predict_batch_indices_follow_a_shuffled_order() -> None:
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True)
    first = _predict(loader, DeterminismCallback(seed=3))
    assert first.batch_indices == first.predicted
    assert sorted(i for batch in first.batch_indices for i in batch) == list(range(12))
    assert _predict(loader, DeterminismCallback(seed=3)).batch_indices == first.batch_indices


@pytest.mark.parametrize("sanity", [0, 2])
def test_the_same_loader_as_train_and_val_loader(sanity: int) -> None:
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True)
    shared = _fit(loader, loader, num_sanity_val_steps=sanity)
    separate = _fit(
        DataLoader(Indexed(), batch_size=4, shuffle=True),
        DataLoader(Indexed(), batch_size=4, shuffle=True),
        num_sanity_val_steps=sanity,
    )
    assert shared.seen == separate.seen
    assert _digest(shared) == _digest(separate)
    # validation does not change training: without it the weights are the same too
    assert _digest(_fit(DataLoader(Indexed(), batch_size=4, shuffle=True), limit_val_batches=0)) == _digest(shared)


def test_a_second_trainer_with_the_same_loader_trains_the_same() -> None:
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True)
    first = _fit(loader, max_epochs=1)
    second = _fit(loader, max_epochs=1)
    assert second.seen == first.seen
    assert _digest(second) == _digest(first)
    assert _digest(_fit(loader, seed=4, max_epochs=1)) != _digest(first)  # the control: the digest sees a change


def test_a_datamodule_fits_then_predicts() -> None:
    data = Data()
    callback = DeterminismCallback(seed=3)
    model = Tiny()
    _trainer(callback, max_epochs=2).fit(model, datamodule=data)
    direct = _fit(DataLoader(data.dataset, batch_size=4, shuffle=True), DataLoader(data.dataset, batch_size=4))
    assert _digest(model) == _digest(direct)
    writer = Writer()
    _trainer(callback, writer).predict(model, datamodule=data, return_predictions=False)
    assert writer.batch_indices == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


class GeneratorSampler(Sampler[int]):
    """A sampler we do not know that draws its order from its `generator` attribute."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.generator: torch.Generator | None = None

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(self.n, generator=self.generator).tolist()

    def __len__(self) -> int:
        return self.n


def _loader_kinds() -> list[Any]:
    return [
        pytest.param(lambda: DataLoader(Indexed(), batch_size=4, shuffle=True), id="shuffle"),
        pytest.param(lambda: DataLoader(Indexed(), batch_size=4, sampler=GeneratorSampler(12)), id="custom-sampler"),
        pytest.param(
            lambda: DataLoader(Indexed(), batch_sampler=BatchSampler(GeneratorSampler(12), 4, False)),
            id="batch-sampler",
        ),
        pytest.param(lambda: DataLoader(Indexed(), batch_size=None, shuffle=True), id="no-batching"),
    ]


def _attributes(loader: DataLoader[Any]) -> dict[str, Any]:
    sampler = loader.batch_sampler.sampler if loader.batch_sampler is not None else loader.sampler
    names = ("batch_sampler", "sampler", "dataset", "collate_fn", "generator", "worker_init_fn")
    out = {name: getattr(loader, name) for name in names}
    out["sampler.generator"] = getattr(sampler, "generator", None)
    out["__dict__"] = dict(vars(loader))
    return out


@pytest.mark.parametrize("make", _loader_kinds())
def test_the_users_loader_is_given_back_as_it_was(make: Any) -> None:
    loader = make()
    before = _attributes(loader)
    callback = DeterminismCallback(seed=3)
    model = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the custom sampler's warning is tested elsewhere
        _trainer(callback, max_epochs=1).fit(model, loader, loader)
        after_fit = _attributes(loader)
        trainer = _trainer(callback)
        trainer.validate(model, loader, verbose=False)
        trainer.test(model, loader, verbose=False)
        trainer.predict(model, loader, return_predictions=False)
    after = _attributes(loader)
    for name, value in before.items():
        if name == "__dict__":
            assert after_fit[name].keys() == value.keys()
            assert after[name].keys() == value.keys()
            assert all(after[name][k] is v for k, v in value.items())
        else:
            assert after_fit[name] is value, name
            assert after[name] is value, name


def test_predict_on_a_loader_the_trainer_prepared() -> None:
    callback = DeterminismCallback(seed=3)
    model = Tiny()
    trainer = _trainer(callback, max_epochs=1)
    trainer.fit(model, DataLoader(Indexed(6), batch_size=2))
    writer = Writer()
    _trainer(callback, writer).predict(model, trainer.train_dataloader, return_predictions=False)
    assert writer.batch_indices == [[0, 1], [2, 3], [4, 5]]
    assert writer.predicted == writer.batch_indices


class EpochShuffled(Sampler[int]):
    """Reshuffles in `set_epoch`, as DistributedSampler does; no `generator` attribute."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize(
    ("form", "workers"), [("sampler", 0), ("batch_sampler", 0), ("batch_sampler", 2), ("no-batching", 0)]
)
def test_a_sampler_that_reshuffles_in_set_epoch_gets_each_epoch(form: str, workers: int) -> None:
    def make() -> DataLoader[Any]:
        kwargs: dict[str, Any] = {
            "sampler": {"sampler": EpochShuffled(12), "batch_size": 4},
            "batch_sampler": {"batch_sampler": BatchSampler(EpochShuffled(12), 4, False)},
            "no-batching": {"sampler": EpochShuffled(12), "batch_size": None},
        }[form]
        return DataLoader(Indexed(), num_workers=workers, **kwargs)

    def epochs() -> list[list[int]]:
        # its order replays from the epoch: supported and exact, so no warning (warnings are errors here)
        seen = _fit(make(), max_epochs=3, limit_val_batches=0).seen
        flat = [i for batch in seen for i in (batch if isinstance(batch, list) else [batch])]
        return [flat[12 * e : 12 * (e + 1)] for e in range(3)]

    first = epochs()
    for epoch, order in enumerate(first):
        sampler = EpochShuffled(12)
        sampler.set_epoch(epoch)
        assert order == list(sampler), epoch  # the sampler got set_epoch(epoch) before the epoch's pass
    assert len({tuple(order) for order in first}) == 3
    assert epochs() == first


class Sharded(DistributedSampler[int]):
    """A DistributedSampler subclass, as Lightning's `UnrepeatedDistributedSamplerWrapper` for predict."""

    def __init__(self, n: int) -> None:
        super().__init__(Indexed(n), num_replicas=1, rank=0, shuffle=True)


class EpochAtBatch(pl.Callback):
    """The epoch of the evaluation loader's sampler at each batch, reached as Lightning reaches it
    (`loader.batch_sampler.sampler`: under the predict index recorder too)."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def _record(self, loader: Any) -> None:
        self.epochs.append(loader.batch_sampler.sampler.epoch)

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._record(trainer.val_dataloaders)

    def on_predict_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._record(trainer.predict_dataloaders)


@pytest.mark.parametrize("call", ["predict", "validate", "fit"])
def test_an_evaluation_sampler_keeps_the_epoch_lightning_sets(call: str) -> None:
    """Lightning sets evaluation samplers' epoch to the training epochs done (`_set_sampler_epoch`): every batch
    sees the epoch it sees in plain Lightning, and the user's sampler is left with Lightning's epoch."""

    def epochs(callback: DeterminismCallback | None) -> tuple[list[int], int]:
        sampler = Sharded(6)
        loader = DataLoader(Indexed(6), batch_size=2, sampler=sampler)
        recorder = EpochAtBatch()
        trainer = _trainer(*([callback] if callback else []), recorder, max_epochs=3, num_sanity_val_steps=0)
        model = Tiny()
        with warnings.catch_warnings():
            # validation loaders with a sampler of no known type are warned about (predict ones are not)
            warnings.filterwarnings("ignore", "Sharded is not a sampler lightning-repro knows", ReproWarning)
            if call == "fit":  # a validation after each epoch
                trainer.fit(model, DataLoader(Indexed(6), batch_size=2), loader)
            else:
                trainer.fit_loop.epoch_progress.current.processed = 2  # as if two epochs were trained
                getattr(trainer, call)(model, loader)
        return recorder.epochs, sampler.epoch

    plain = epochs(None)
    assert len(plain[0]) == (9 if call == "fit" else 3)
    assert len(set(plain[0])) == (3 if call == "fit" else 1)
    assert epochs(DeterminismCallback(seed=3)) == plain
