"""A fit continued on the same Trainer (``fit_loop.max_epochs`` raised, ``fit`` called again) is one longer fit.

Users train for a while, look, and go on with the same Trainer and module. With the callback, two epochs and then two
more are bitwise the same run as four epochs at once (weights, the last logged values), with 0 and 2 workers, and
the second ``fit`` says nothing about a resume (it restores nothing: no checkpoint is read). Plain Lightning gives
another run for the second half (its workers and samplers are re-seeded from the global stream, which the first fit
moved), so the equality below is ours. Each ``fit`` calls ``configure_optimizers`` again (a fresh optimizer and
scheduler, in plain Lightning too), so the module here steps a stateless SGD.
"""

from __future__ import annotations

import gc
import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import streaming_pipelines
import torch
from helpers import fast_trainer
from scenario import digest
from torch.utils.data import DataLoader, Dataset

from lightning_repro import DeterminismCallback


class _Noisy(Dataset):  # type: ignore[type-arg]
    """Samples drawn from the torch stream (an augmentation)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((6,), i / 48) + 0.1 * torch.randn(6), torch.tensor([float(i % 3)])


class _Net(pl.LightningModule):
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Dropout(0.3), torch.nn.Linear(12, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # stateless: each `fit` calls configure_optimizers again (a new optimizer and scheduler, in plain Lightning too)
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(_Noisy(), batch_size=8, shuffle=True, num_workers=self.workers)


def _run(first: int, workers: int, caplog: pytest.LogCaptureFixture) -> tuple[str, ...]:
    torch.manual_seed(11)  # the module's initialisation, the same for both runs
    module = _Net(workers)
    trainer = fast_trainer([DeterminismCallback(seed=5)], max_epochs=first)
    trainer.fit(module)
    if first < 4:
        trainer.fit_loop.max_epochs = 4
        caplog.clear()
        with caplog.at_level(logging.INFO):
            trainer.fit(module)
        assert not [r.getMessage() for r in caplog.records if "resum" in r.getMessage().lower()]
    metrics = {k: v.detach().clone() for k, v in sorted(trainer.callback_metrics.items())}
    return (
        digest(dict(module.state_dict())),
        digest(metrics),
        str(trainer.global_step),
        str(trainer.current_epoch),
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_two_epochs_then_two_more_are_four_epochs(workers: int, caplog: pytest.LogCaptureFixture) -> None:
    whole = _run(4, workers, caplog)
    assert whole[2] == "24"  # 6 batches an epoch: the run did train for four epochs
    assert _run(2, workers, caplog) == whole


# ------------------------------------------------------------------------------------------- streaming loaders
class _Streamed(pl.LightningModule):
    """A module reading one of tests/streaming_pipelines.py's pipelines; it records each batch it trains on."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.net = torch.nn.Sequential(torch.nn.Linear(streaming_pipelines.DIM, 12), torch.nn.Dropout(0.3))
        self.seen: list[tuple[Any, ...]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _, index = streaming_pipelines.as_tuple(batch)
        self.seen.append((self.current_epoch, batch_idx, digest({"x": x}), index.tolist()))
        return self.net(x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self.trainer.sanity_checking:  # each fit's own (a continued fit runs one more)
            self.seen.append(
                ("val", self.global_step, batch_idx, digest({"x": streaming_pipelines.as_tuple(batch)[0]}))
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:  # a new loader at every fit, as a module or datamodule makes it
        return streaming_pipelines.train_loader(self.cfg, 0, 1)

    def val_dataloader(self) -> Any:  # the same pipeline, shuffled too (its set_epoch is the train loader's)
        given = list(streaming_pipelines._SET_EPOCH)
        persistent = bool(self.cfg.get("val_persistent"))
        loader = streaming_pipelines.train_loader({**self.cfg, "batch_size": 8, "persistent_workers": persistent}, 0, 1)
        streaming_pipelines._SET_EPOCH[:] = given
        return loader


def _streamed(cfg: dict[str, Any], root: Path, fits: list[dict[str, Any]]) -> tuple[str, list[tuple[Any, ...]]]:
    """The weights and batches of ``fit`` called once per entry of ``fits`` (its loop limits) on one Trainer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # webdataset leaves its tar files to the garbage collector
        made = _fits(cfg, root, fits)
        gc.collect()  # a validation pass cut by limit_val_batches: its generators, open files
    return made


def _fits(cfg: dict[str, Any], root: Path, fits: list[dict[str, Any]]) -> tuple[str, list[tuple[Any, ...]]]:
    callback = DeterminismCallback(seed=5)  # before the module: it pins the initialisation
    module = _Streamed(cfg)
    validation = {"limit_val_batches": 3, "num_sanity_val_steps": 2} if cfg.get("val") else {"limit_val_batches": 0}
    trainer = fast_trainer([callback], max_epochs=fits[0]["max_epochs"], default_root_dir=root, **validation)
    for limits in fits:
        trainer.fit_loop.max_epochs = limits["max_epochs"]
        trainer.fit_loop.epoch_loop.max_steps = limits.get("max_steps", -1)
        trainer.fit(module, ckpt_path=limits.get("ckpt_path"))
        if "save" in limits:
            trainer.save_checkpoint(limits["save"])
    return digest(dict(module.state_dict())), module.seen


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")  # litdata's reader (torch's warning)
@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined:UserWarning")  # torch's, of litdata's
@pytest.mark.parametrize(
    "lib",
    [
        # litdata's StreamingDataLoader counts its passes (its shuffle's seed): a new loader counted from 0 again
        "litdata",
        # torchdata.nodes: Lightning drops the epoch's first iterator (made before on_train_epoch_start) in a continued
        # fit, which torchdata counted as a pass of the epoch: the real one was keyed as the epoch's second
        "nodes",
        # webdataset's detshuffle counts its passes in the copy that iterates (the main process's without workers):
        # its validation passes were seeded by their count in the process
        "wds_det",
    ],
)
# "saved": the first fit's file, saved after it, resumed by the same Trainer (Lightning loads the loader's state)
@pytest.mark.parametrize("stop", ["epoch", "max_steps", "saved"])
def test_a_continued_fit_reads_a_stream_as_the_longer_fit_does(
    lib: str, stop: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """One epoch (or 7 steps: Lightning's continued fit then starts the next epoch) then ``fit`` again on the same
    Trainer: the batches of the second fit are those of the 2-epoch fit's, as are the weights. No
    worker prints a traceback (see ``test_torchdata_nodes.py``: a stopped iterator inherited by a later worker).
    A shuffled litdata or webdataset validation loader (a pass at each epoch's end) reads the longer fit's batches too:
    its passes were seeded by its count of them in the process, which the second fit's sanity check moved."""
    data = streaming_pipelines.written_data(tmp_path / "data")
    workers = 0 if lib == "wds_det" else 2
    cfg = {"pipeline": {"lib": lib, "data": data}, "batch_size": 4, "num_workers": workers, "val": lib != "nodes"}
    whole, seen = _streamed(cfg, tmp_path / "whole", [{"max_epochs": 2}])
    epoch_0 = [s for s in seen if s[0] == 0]
    assert (len(epoch_0), len(seen)) == (10, 26 if cfg["val"] else 20)
    first: dict[str, Any] = {"max_epochs": 1} if stop != "max_steps" else {"max_epochs": 2, "max_steps": 7}
    second: dict[str, Any] = {"max_epochs": 2}
    if stop == "saved":
        first["save"] = second["ckpt_path"] = str(tmp_path / "after-fit.ckpt")
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="lightning_repro"):
        continued, seen_continued = _streamed(cfg, tmp_path / "continued", [first, second])
    assert "can only test a child process" not in capfd.readouterr().err
    if stop != "max_steps":
        assert (continued, seen_continued) == (whole, seen)
    else:  # the rest of epoch 0 is not read (Lightning's continued fit), epoch 1 is the longer fit's
        trained = [s for s in seen_continued if s[0] != "val"]
        assert trained == epoch_0[:7] + [s for s in seen if s[0] == 1]
    said = [r.getMessage() for r in caplog.records if "given on from this Trainer" in r.getMessage()]
    assert said == (
        [
            "[rank: 0] train loader 0: litdata's pass count 1 given on from this Trainer's last fit (training"
            " continued: a new loader counts from 0)"
        ]
        if lib == "litdata" and stop != "saved"
        else []
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")  # litdata's reader (torch's warning)
@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined:UserWarning")  # torch's, of litdata's
def test_persistent_validation_workers_read_what_workers_started_at_each_pass_read(tmp_path: Path) -> None:
    """A shuffled litdata validation loader (2 workers): with persistent workers, whose copies keep the pass count
    (the shuffle's seed) of their first pass, each validation reads the batches it reads with workers started at
    every pass; and a continued fit validates as the longer fit does."""
    data = streaming_pipelines.written_data(tmp_path / "data")
    cfg = {"pipeline": {"lib": "litdata", "data": data}, "batch_size": 4, "num_workers": 2, "val": True}
    fresh = _streamed(cfg, tmp_path / "fresh", [{"max_epochs": 2}])
    validated = [s for s in fresh[1] if s[0] == "val"]
    assert len(validated) == 6  # 3 batches at each of 2 epoch ends, each pass in another order
    assert len({s[3] for s in validated}) == 6
    cfg["val_persistent"] = True
    persistent = _streamed(cfg, tmp_path / "persistent", [{"max_epochs": 2}])
    assert persistent == fresh
    assert _streamed(cfg, tmp_path / "continued", [{"max_epochs": 1}, {"max_epochs": 2}]) == fresh
