"""What the user's ``on_train_epoch_start`` sets, which a mid-epoch resume skips: compared, and said when it differs.

A LightningModule that sets an epoch's value in ``on_train_epoch_start`` (``self.scale = 1 + epoch``) and reads it
in ``training_step`` resumed mid-epoch with ``__init__``'s value (Lightning skips the hook there) and was said
exact. In one process: the uninterrupted run saves in the middle of epoch 1 (and at the end of epoch 0), a new
Trainer resumes from the file; the warning, the resume line and the weights are compared.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_repro import DeterminismCallback, NotExactWarning, digest_tensors
from lightning_repro._warn import RESUME_LOGGER
from lightning_repro.checkpoint.attributes import attribute_values, validate_ignored

MID, END = (1, 3), (0, 7)  # (epoch, batch) of the checkpoint: in the middle of epoch 1, the last batch of epoch 0


class EpochScaled(helpers.SmallRegressor):
    """Reads in training_step what its on_train_epoch_start sets: the hook a mid-epoch resume skips."""

    def __init__(self, *, restore: bool = False) -> None:
        super().__init__()
        self.scale = 1.0
        self.restore = restore
        self.epoch_losses: list[float] = []  # bookkeeping, reset by the hook: the resumed epoch's is [] too
        self.epoch_t0 = 0.0  # a timestamp the hook sets: left out

    def on_train_epoch_start(self) -> None:
        self.scale = 1.0 + self.current_epoch
        self.epoch_losses = []
        self.epoch_t0 = time.time()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.restore:  # the fix the warning suggests
            self.scale = 1.0 + checkpoint["epoch"]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x) * self.scale, y)
        self.epoch_losses.append(float(loss.detach()))
        return loss


class Curriculum(Callback):
    """A user's callback setting the epoch's level in its own on_train_epoch_start (after ours in the list)."""

    def __init__(self) -> None:
        self.level = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.level = trainer.current_epoch + 1


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)


def _fit(
    model: pl.LightningModule,
    ckpt: Path,
    *,
    at: tuple[int, int] | None,
    extra: tuple[Callback, ...] = (),
    first: tuple[Callback, ...] = (),
    logger: Any = False,
    **kw: Any,
) -> str:
    callbacks: list[Callback] = [*first, DeterminismCallback(seed=3, **kw), *extra]
    if at is not None:
        callbacks.append(helpers.SaveAt(ckpt, at))
    trainer = helpers.fast_trainer(callbacks, max_epochs=2, default_root_dir=ckpt.parent, logger=logger)
    trainer.fit(model, _loader(), ckpt_path=None if at is not None else ckpt)
    return digest_tensors(dict(model.state_dict()))


def _resume(model: pl.LightningModule, ckpt: Path, caplog: pytest.LogCaptureFixture, **kw: Any) -> tuple[str, list]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        digest = _fit(model, ckpt, at=None, **kw)
    [line] = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    return digest, [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)], line


def test_a_value_the_skipped_epoch_start_hook_set_is_not_exact_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "mid.ckpt"
    uninterrupted = _fit(EpochScaled(), ckpt, at=MID)
    entry = torch.load(ckpt, weights_only=True)["callbacks"]["DeterminismCallback"]
    recorded = sorted(k for k in entry["ranks"][0]["restore_sha256"] if k.startswith("attribute"))
    # what the hook set, as it set it (the list: reset to []); not the timestamp
    assert recorded == sorted(f"attribute {k}module.{n}" for n in ("epoch_losses", "scale") for k in ("", "value "))
    assert entry["ranks"][0]["restore_sha256"]["attribute value module.scale"] == "2.0"
    digest, messages, line = _resume(EpochScaled(), ckpt, caplog)
    assert digest != uninterrupted  # the warning is true: the resumed epoch trained with scale 1.0
    [message] = messages
    assert "module.scale" in message
    assert "2.0 after those hooks, 1.0 now" in message
    assert "epoch_losses" not in message
    assert "epoch_t0" not in message
    assert ": NOT exact: " in line
    assert "on_train_epoch_start" in line


@pytest.mark.parametrize(
    ("restore", "at"),
    [(True, MID), (False, END)],
    ids=["mid-epoch-given-back-in-on_load_checkpoint", "epoch-end-the-hook-runs-again"],
)
def test_a_resume_that_has_the_hooks_values_is_exact_and_says_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, restore: bool, at: tuple[int, int]
) -> None:
    ckpt = tmp_path / "ckpt.ckpt"
    uninterrupted = _fit(EpochScaled(restore=restore), ckpt, at=at)
    digest, messages, line = _resume(EpochScaled(restore=restore), ckpt, caplog)
    assert messages == []
    assert ": exact" in line
    assert digest == uninterrupted


def test_a_user_callback_after_ours_is_compared_too_and_can_be_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "mid.ckpt"
    _fit(EpochScaled(restore=True), ckpt, at=MID, extra=(Curriculum(),))
    _, messages, line = _resume(EpochScaled(restore=True), ckpt, caplog, extra=(Curriculum(),))
    [message] = messages
    assert "callback[Curriculum].level" in message
    assert "2 after those hooks, 0 now" in message
    _, messages, line = _resume(
        EpochScaled(restore=True), ckpt, caplog, extra=(Curriculum(),), ignore_attributes=["callback[Curriculum].level"]
    )
    assert messages == []
    assert ": exact" in line


def test_a_user_callback_before_ours_in_the_list_is_compared_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its on_train_epoch_start runs before ours: the digests before the hooks are taken before every callback's."""
    ckpt = tmp_path / "mid.ckpt"
    uninterrupted = _fit(EpochScaled(restore=True), ckpt, at=MID, first=(Curriculum(),))
    digest, messages, line = _resume(EpochScaled(restore=True), ckpt, caplog, first=(Curriculum(),))
    [message] = messages
    assert "callback[Curriculum].level" in message
    assert "2 after those hooks, 0 now" in message
    assert ": NOT exact: " in line
    assert digest == uninterrupted  # the level is not read by training: the warning says what the resume lost


class StepDecayed(EpochScaled):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


@pytest.mark.parametrize("interval", [None, "epoch"])
def test_lightnings_learning_rate_monitor_is_not_compared(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, interval: str | None
) -> None:
    """``LearningRateMonitor`` appends the epoch's rate to its ``lrs`` at epoch start (a per-epoch scheduler, or
    ``logging_interval="epoch"``): a history training never reads. A mid-epoch resume was said NOT exact (a
    NotExactWarning naming ``callback[LearningRateMonitor].lrs``) while it was exact, and every entry written after
    it held another digest of ``lrs`` than the uninterrupted run's."""
    ckpt, later = tmp_path / "mid.ckpt", tmp_path / "later.ckpt"

    def monitor() -> tuple[Callback, ...]:
        return (LearningRateMonitor(logging_interval=interval), helpers.SaveAt(later, (1, 6)))

    uninterrupted = _fit(StepDecayed(restore=True), ckpt, at=MID, extra=monitor(), logger=CSVLogger(tmp_path, "a"))
    written = torch.load(later, weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"][0]["restore_sha256"]
    logger = CSVLogger(tmp_path, "b")
    digest, messages, line = _resume(StepDecayed(restore=True), ckpt, caplog, extra=monitor(), logger=logger)
    assert messages == []
    assert ": exact" in line, line
    assert digest == uninterrupted
    again = torch.load(later, weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"][0]["restore_sha256"]
    assert again == written
    assert not any("LearningRateMonitor" in key for key in again)


class Holder(Callback):
    def __init__(self) -> None:
        self.count, self.name, self.values = 3, "a", {"k": [1, 2.5, None]}
        self.tensor = torch.ones(2)
        self.started = time.time()  # a timestamp
        self.model = nn.Linear(2, 2)  # a module: in the state_dict
        self.obj = object()  # not a plain value
        self.big = list(range(20_000))  # too many values


class MyMonitor(LearningRateMonitor):
    def __init__(self) -> None:
        super().__init__()
        self.seen = 0


def test_what_is_looked_at() -> None:
    """Not Lightning's own callbacks, nor a subclass of one (LearningRateMonitor's ``lrs`` was compared: a false
    NotExactWarning on a mid-epoch resume)."""
    monitor = LearningRateMonitor()
    monitor.lrs = {"lr-SGD": [0.1]}
    trainer = SimpleNamespace(callbacks=[Holder(), monitor, MyMonitor()])
    found = attribute_values(trainer, EpochScaled(), ignore={"callback[Holder].name"})
    assert sorted(found) == [
        "callback[Holder].count",
        "callback[Holder].tensor",
        "callback[Holder].values",
        "module.epoch_losses",
        "module.epoch_t0",  # 0.0 is no timestamp
        "module.lr",
        "module.restore",
        "module.scale",
    ]


@pytest.mark.parametrize("bad", ["module.scale", 3, [1]])
def test_ignore_attributes_must_be_a_list_of_paths(bad: Any) -> None:
    with pytest.raises(TypeError, match="ignore_attributes"):
        validate_ignored(bad)
    flags, before = torch.are_deterministic_algorithms_enabled(), torch.get_rng_state()
    torch.use_deterministic_algorithms(False)
    try:
        with pytest.raises(TypeError, match="ignore_attributes"):
            DeterminismCallback(seed=0, ignore_attributes=bad)
        # refused before anything process-wide was set (it had set the flags and re-seeded the streams)
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        torch.use_deterministic_algorithms(flags)


class LevelDataset(Dataset):  # type: ignore[type-arg]
    """Its samples carry the curriculum level a callback sets through the loader."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
        self.level = 0

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] * (1 + self.level), self.y[i]


class LoaderCurriculum(Callback):
    """Sets the epoch's level on the train loader's dataset, as users write it."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.train_dataloader.dataset.level = trainer.current_epoch + 1


class Scales(helpers.SmallRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(round(float(batch[0].abs().sum()), 3))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("workers", [0, 2])
def test_what_a_callback_sets_on_the_loaders_dataset_reaches_the_dataset(tmp_path: Path, workers: int) -> None:
    """Our view of the dataset passes the attributes set on it to the user's dataset (it kept them before)."""
    seen = {}
    for ours in (False, True):
        model = Scales()
        callbacks: list[Callback] = [LoaderCurriculum(), *([DeterminismCallback(seed=3)] if ours else [])]
        loader = DataLoader(LevelDataset(), batch_size=8, num_workers=workers)
        helpers.fast_trainer(callbacks, max_epochs=2, default_root_dir=tmp_path).fit(model, loader)
        seen[ours] = model.seen[-4:]  # epoch 1 (level 2 in both: what plain Lightning's dataset reads)
        assert loader.dataset.level == 2
    assert seen[True] == seen[False]


@pytest.mark.parametrize(("workers", "order"), [(0, "ours-first"), (2, "ours-first"), (0, "theirs-first")])
def test_a_level_set_on_the_train_dataset_in_the_skipped_hook_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, workers: int, order: str
) -> None:
    ckpt = tmp_path / "mid.ckpt"

    def fit(resume: bool) -> tuple[str, list[str], str]:
        ours_first = [DeterminismCallback(seed=3), LoaderCurriculum()]
        callbacks: list[Callback] = ours_first if order == "ours-first" else ours_first[::-1]
        if not resume:
            callbacks.append(helpers.SaveAt(ckpt, (1, 1)))
        model = helpers.SmallRegressor()
        trainer = helpers.fast_trainer(callbacks, max_epochs=2, default_root_dir=tmp_path)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = DataLoader(LevelDataset(), batch_size=8, num_workers=workers, shuffle=True)
            trainer.fit(model, loader, ckpt_path=ckpt if resume else None)
        lines = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
        said = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
        return digest_tensors(dict(model.state_dict())), said, "".join(lines)

    uninterrupted, said, _ = fit(resume=False)
    assert said == []
    digest, said, line = fit(resume=True)
    assert digest != uninterrupted  # the resumed epoch read level 0: the warning is true
    [message] = said
    assert "train_dataset[0].level (2 after those hooks, 0 now)" in message.replace("`", "")
    assert ": NOT exact: " in line


def test_the_loops_are_left_as_found_after_fit_and_after_a_failed_fit(tmp_path: Path) -> None:
    """Our watchers sit on the loops' instances during fit only: their attributes after it are plain Lightning's."""

    class Fails(helpers.SmallRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.current_epoch == 1:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    def loop_attributes(ours: bool, model: pl.LightningModule) -> list[dict[str, type]]:
        callbacks: list[Callback] = [DeterminismCallback(seed=3)] if ours else []
        trainer = helpers.fast_trainer(callbacks, max_epochs=2, default_root_dir=tmp_path)
        with contextlib.suppress(RuntimeError):
            trainer.fit(model, _loader())
        fit_loop = trainer.fit_loop
        return [{k: type(v) for k, v in vars(loop).items()} for loop in (fit_loop, fit_loop.epoch_loop)]

    for model in (helpers.SmallRegressor, Fails):
        assert loop_attributes(True, model()) == loop_attributes(False, model())
