"""A checkpoint written in ``on_train_batch_end``: what follows its writer in that hook runs again on resume.

``ModelCheckpoint(every_n_train_steps=...)`` saves in ``on_train_batch_end``; after it Lightning calls that hook on
the checkpoint callbacks after it and then on the LightningModule. The module's hook is where users move an EMA
teacher towards the student (BYOL, DINO, MoCo) or count batches: before, the resumed run never ran it for the
checkpoint's batch, and its teacher parted from the uninterrupted run's bit by bit while the resume line said
"exact". Here the module's hook reads all three arguments (the outputs, the batch, its index) and moves buffers
with them; a resume from a mid-epoch step checkpoint must end with the uninterrupted run's buffers and weights.
Where the arguments cannot be given again, the resume says so. The slow test, in fresh processes: a monitored
``ModelCheckpoint`` after the writer defers its save at an epoch's last batch, and every file is the uninterrupted
run's.
"""

from __future__ import annotations

import csv
import hashlib
import warnings
from pathlib import Path
from typing import Any

import helpers
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback
from lightning_repro.exceptions import NotExactWarning

CHECKPOINT = "epoch=0-step=5.ckpt"  # written on batch 4 of 12, mid-epoch

pytestmark = pytest.mark.filterwarnings("ignore:The dirpath has changed:UserWarning")  # each run has its folder


class Teacher(helpers.SmallRegressor):
    """Moves an EMA teacher and sums of its hook's arguments in ``on_train_batch_end``."""

    def __init__(self, extra: Any = None) -> None:
        super().__init__()
        self.extra = extra
        self.register_buffer("teacher", torch.zeros(8, 4))
        self.register_buffer("seen", torch.zeros(3, dtype=torch.float64))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return {"loss": loss, "extra": self.extra} if self.extra is not None else loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.teacher.mul_(0.9).add_(0.1 * self.net[0].weight.detach())
        self.seen += torch.stack([outputs["loss"].double(), batch[0].double().sum(), torch.tensor(float(batch_idx))])


def _loader(workers: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(24, 4, generator=generator), torch.randn(24, 1, generator=generator))
    return DataLoader(data, batch_size=2, shuffle=True, num_workers=workers)


def _fit(root: Path, *, resume: Path | None = None, workers: int = 0, **options: Any) -> tuple[Teacher, str]:
    extra = options.pop("extra", None)
    model = Teacher(extra)
    callbacks = [
        DeterminismCallback(seed=5, **options),
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=5, save_top_k=-1),
    ]
    trainer = helpers.fast_trainer(callbacks, max_epochs=2, enable_checkpointing=True, default_root_dir=root)
    trainer.fit(model, _loader(workers), ckpt_path=resume)
    state = {k: v for k, v in model.state_dict().items()}
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for _, v in sorted(state.items()))).hexdigest()
    return model, digest


@pytest.mark.parametrize("workers", [0, 2])
def test_the_modules_hook_runs_again_for_the_checkpoints_batch(
    tmp_path: Path, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    _, reference = _fit(tmp_path / "a", workers=workers)
    entry = torch.load(tmp_path / "a" / "ckpt" / CHECKPOINT, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry["remainder"]["hook"] == "on_train_batch_end"
    assert entry["remainder"]["callbacks"] == [["<LightningModule>", -1]]
    assert "outputs" in entry["ranks"][0]["batch_end"]
    _, resumed = _fit(tmp_path / "b", resume=tmp_path / "a" / "ckpt" / CHECKPOINT, workers=workers)
    assert resumed == reference  # the teacher, the sums of the hook's arguments and the weights
    assert ": exact (restore verified" in caplog.text


def test_without_sample_keyed_loading_the_file_keeps_the_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``sample_keyed=False``: the batch cannot be loaded again as it was, so the checkpoint keeps it (as the hooks
    saw it) and the module's hook runs with it on resume (the resume line still says what ``sample_keyed=False``
    leaves out: draws while loading, none here)."""
    _, reference = _fit(tmp_path / "a", sample_keyed=False)
    entry = torch.load(tmp_path / "a" / "ckpt" / CHECKPOINT, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert len(entry["ranks"][0]["batch_end"]["batch"]) == 2  # (x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, resumed = _fit(tmp_path / "b", resume=tmp_path / "a" / "ckpt" / CHECKPOINT, sample_keyed=False)
    assert resumed == reference
    assert not [w for w in caught if "`on_train_batch_end`" in str(w.message)]
    assert "sample_keyed=False: what the dataset draws while loading is not restored" in caplog.text


def test_outputs_a_checkpoint_cannot_hold_are_named(tmp_path: Path) -> None:
    _fit(tmp_path / "a", extra=Path("x"))
    entry = torch.load(tmp_path / "a" / "ckpt" / CHECKPOINT, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry["ranks"][0]["batch_end"] == {"unstorable": "PosixPath"}
    with pytest.warns(NotExactWarning, match=r"its outputs \(PosixPath\) are not in the file"):
        _fit(tmp_path / "b", resume=tmp_path / "a" / "ckpt" / CHECKPOINT, extra=Path("x"))


def test_a_module_without_the_hook_adds_nothing_to_the_entry(tmp_path: Path) -> None:
    """Only the checkpoint callbacks after the writer, or the module's own hook, make a remainder."""
    model = helpers.SmallRegressor()
    files = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer = helpers.fast_trainer(
        [DeterminismCallback(seed=5), files], max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path
    )
    trainer.fit(model, _loader(0))
    entry = torch.load(tmp_path / "ckpt" / CHECKPOINT, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry.get("remainder") is None
    assert "batch_end" not in entry["ranks"][0]


@pytest.mark.slow
def test_a_monitored_checkpoint_after_the_writer_defers_its_save_as_in_the_uninterrupted_run(runs: Any) -> None:
    """In fresh processes: validation every 5 batches, accumulation 2, ``ModelCheckpoint(every_n_train_steps=3,
    save_last=True)`` and a ``ModelCheckpoint(monitor="val_loss", every_n_train_steps=2)`` after it, BatchNorm, EMA,
    a CSVLogger, 2 workers; killed after 15 batches, resumed from ``last.ckpt`` (step 6, epoch 0's last batch) in the
    same folder. At that batch the monitored callback, after the writer, defers its save to the next validation
    (Lightning's ``_defer_save_until_validation``, on an epoch's last batch): the resumed run defers it too, and
    writes ``best-step=11.ckpt`` where the uninterrupted run did; every file equals the uninterrupted run's."""
    cfg = {
        "accumulate": 2,
        "val": 5,
        "ckpt_monitor_every_n_steps": 2,
        "ckpt_every_n_steps": 3,
        "save_last": True,
        "csv_logger": True,
        "batchnorm": True,
        "ema": True,
        "num_workers": 2,
        "max_epochs": 3,
    }
    reference, _, resumed, out = runs.resumed_in_place(cfg, 15, (6, 12))
    assert Path(out, "ckpt", "best-step=11.ckpt").is_file()
    for key in ("params", "optimizer", "global_step", "epoch", "lr", "metrics"):
        assert resumed[key] == reference[key], key


class LoggingTeacher(Teacher):
    """Logs in its own ``on_train_batch_end``: a step value, an epoch mean (weighted by the batch size), a bar value."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.log("teacher", self.teacher.sum(), prog_bar=True)
        self.log("teacher_mean", self.teacher.sum(), on_step=False, on_epoch=True)


class MetricsAtBatchStart(Callback):
    """What ``trainer.logged_metrics`` & co. hold when each batch starts."""

    def __init__(self) -> None:
        self.seen: dict[int, list[dict[str, str]]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        dicts = (trainer.logged_metrics, trainer.callback_metrics, trainer.progress_bar_metrics)
        self.seen[trainer.global_step] = [{k: _bits(v) for k, v in sorted(d.items())} for d in dicts]


def _bits(value: Any) -> str:
    return torch.as_tensor(value).double().numpy().tobytes().hex()


class ValidatedLoggingTeacher(LoggingTeacher):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))


def _logged_fit(
    root: Path, resume: Path | None = None, *, every: int = 5, workers: int = 0, validate: bool = False
) -> tuple[list[dict[str, str]], dict[int, Any], str]:
    model, spy = (ValidatedLoggingTeacher() if validate else LoggingTeacher()), MetricsAtBatchStart()
    callbacks = [
        DeterminismCallback(seed=5),
        spy,
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1),
    ]
    trainer = helpers.fast_trainer(
        callbacks,
        max_epochs=2,
        enable_checkpointing=True,
        default_root_dir=root,
        logger=CSVLogger(root, name="logs", version=0),
        log_every_n_steps=1,
    )
    trainer.fit(model, _loader(workers), _loader(0) if validate else None, ckpt_path=resume)
    with open(root / "logs" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    final = {k: _bits(v) for k, v in sorted(trainer.logged_metrics.items())}
    return rows, spy.seen, repr(final)


def test_what_the_modules_hook_logs_for_the_checkpoints_batch_is_logged_as_in_the_uninterrupted_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``self.log`` in the replayed hook: the batch's log row (step 4, written on resume), the epoch's means (the
    checkpoint's batch counted with its batch size, the aggregates put back kept past the first resumed batch:
    Lightning resets a hook's logged tensors at an epoch's first batch only) and the metric dicts the next batch
    sees, every value bitwise (the resume said "exact" while the row held the previous batch's value)."""
    rows, seen, final = _logged_fit(tmp_path / "a")
    resumed_rows, resumed_seen, resumed_final = _logged_fit(tmp_path / "b", resume=tmp_path / "a" / "ckpt" / CHECKPOINT)
    assert ": exact (restore verified" in caplog.text
    assert resumed_rows[0]["step"] == "4"  # the checkpoint's batch row, written on resume
    assert resumed_rows[0]["teacher"]  # with what the module's hook logged
    assert resumed_rows == rows[-len(resumed_rows) :]  # every row from the checkpoint's batch on, epoch means included
    assert any(row["teacher_mean"] for row in resumed_rows)
    assert {step: seen[step] for step in resumed_seen} == resumed_seen
    assert resumed_final == final


@pytest.mark.parametrize(("workers", "validate"), [(0, False), (2, False), (0, True)])
def test_the_row_of_a_checkpoint_on_an_epochs_last_batch_is_logged_at_that_batchs_step(
    tmp_path: Path, workers: int, validate: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``every_n_train_steps=12``, 12 batches an epoch: the file is written in the epoch's last batch's
    ``on_train_batch_end``, and loaded with that batch's step already counted (the resume runs the epoch-end hooks).
    The module's hook run again and the batch's log row must still be at step 11, as in the uninterrupted run (they
    were at 12 where no validation is due at the epoch's end). The rows of the uninterrupted run up to the
    checkpoint's batch (what the killed run logged) followed by the resumed run's must be all of its rows, bitwise."""
    rows, seen, final = _logged_fit(tmp_path / "a", every=12, workers=workers, validate=validate)
    checkpoint = tmp_path / "a" / "ckpt" / "epoch=0-step=12.ckpt"
    entry = torch.load(checkpoint, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert entry["remainder"]["hook"] == "on_train_batch_end"
    assert entry["pending"]["validate"] is validate
    resumed = _logged_fit(tmp_path / "b", resume=checkpoint, every=12, workers=workers, validate=validate)
    resumed_rows, resumed_seen, resumed_final = resumed
    assert ": exact (restore verified" in caplog.text
    assert resumed_rows[0]["step"] == "11"  # the checkpoint's batch row, written on resume
    assert resumed_rows[0]["teacher"]  # with what the module's hook logged
    assert [row for row in rows if int(row["step"]) < 11] + resumed_rows == rows
    assert {step: seen[step] for step in resumed_seen} == resumed_seen
    assert resumed_final == final


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """24 ``(x, y)`` pairs, streamed."""

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(3)
        for _ in range(24):
            yield torch.randn(4, generator=generator), torch.randn(1, generator=generator)


class TwoLoaderTeacher(Teacher):
    """``Teacher`` trained on the first of two train loaders' batches."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step(batch[0], batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end({"loss": outputs["loss"]}, batch[0], batch_idx)


def _fit_on(
    root: Path, data: Any, callbacks: list[Any], resume: Path | None = None, model: Any = None, **options: Any
) -> None:
    callbacks = [
        DeterminismCallback(seed=5, **options),
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=5, save_top_k=-1),
        *callbacks,
    ]
    trainer = helpers.fast_trainer(callbacks, max_epochs=1, enable_checkpointing=True, default_root_dir=root)
    if model is None:
        model = TwoLoaderTeacher() if isinstance(data, list) else Teacher()
    trainer.fit(model, data, ckpt_path=resume)


def _warned_on_resume(
    tmp_path: Path, data: Any, callbacks: list[Any], resumed_with: list[Any], **options: Any
) -> str:
    _fit_on(tmp_path / "a", data, callbacks, **options)
    with warnings.catch_warnings(record=True) as caught:  # Lightning's own warnings too (a callback it lacks)
        warnings.simplefilter("always")
        _fit_on(tmp_path / "b", data, resumed_with, resume=tmp_path / "a" / "ckpt" / CHECKPOINT)
    [said] = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
    return said


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streamed_batch_is_kept_and_the_hook_runs_again(tmp_path: Path, workers: int) -> None:
    """One streaming train loader (an ``IterableDataset``): the file keeps the batch, and the resumed run's teacher and
    sums of the hook's arguments are the uninterrupted run's."""
    runs = []
    for name, resume in (("a", None), ("b", tmp_path / "a" / "ckpt" / CHECKPOINT)):
        model = Teacher()
        loader = DataLoader(Stream(), batch_size=2, num_workers=workers)
        _fit_on(tmp_path / name, loader, [], resume=resume, model=model)
        runs.append([hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in (model.teacher, model.seen)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kind", ["weighted", "stateful"])
def test_a_batch_whose_samples_lightning_repro_does_not_compute_is_kept(tmp_path: Path, kind: str) -> None:
    """A map-style loader whose sampler's order lightning-repro does not compute (a ``WeightedRandomSampler``, a
    torchdata ``StatefulDataLoader``'s own sampler): the file keeps the batch, the hook runs again with it, and the
    resume is exact. The file did not keep it (the loader was taken over sample-keyed, which was taken to mean it
    could be loaded again) and the resume said NOT exact, the module's hook not run for the checkpoint's batch."""
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(24, 4, generator=generator), torch.randn(24, 1, generator=generator))
    runs = []
    for name, resume in (("a", None), ("b", tmp_path / "a" / "ckpt" / CHECKPOINT)):
        model = Teacher()
        with warnings.catch_warnings(record=True) as caught:  # torchdata calls torch.set_vital, deprecated in 2.13
            warnings.simplefilter("always")
            if kind == "weighted":
                weighted = torch.utils.data.WeightedRandomSampler([1.0] * 24, 24)
                loader: Any = DataLoader(data, batch_size=2, sampler=weighted)
            else:
                stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is in the test lock")
                loader = stateful.StatefulDataLoader(data, batch_size=2, shuffle=True)
            _fit_on(tmp_path / name, loader, [], resume=resume, model=model)
        assert not [w for w in caught if issubclass(w.category, NotExactWarning)], [str(w.message) for w in caught]
        runs.append([hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in (model.teacher, model.seen)])
    kept = torch.load(tmp_path / "a" / "ckpt" / CHECKPOINT, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert len(kept["ranks"][0]["batch_end"]["batch"]) == 2  # (x, y)
    assert runs[0] == runs[1]


def test_several_train_loaders_batch_is_kept(tmp_path: Path) -> None:
    runs = []
    for name, resume in (("a", None), ("b", tmp_path / "a" / "ckpt" / CHECKPOINT)):
        model = TwoLoaderTeacher()
        _fit_on(tmp_path / name, [_loader(0), _loader(0)], [], resume=resume, model=model)
        runs.append([hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in (model.teacher, model.seen)])
    assert runs[0] == runs[1]


class Box:
    """A batch type of the user's, which a ``weights_only`` checkpoint cannot hold."""

    def __init__(self, items: list[Any]) -> None:
        self.x = torch.stack([x for x, _ in items])
        self.y = torch.stack([y for _, y in items])

    def __getitem__(self, i: int) -> torch.Tensor:
        return (self.x, self.y)[i]


def test_a_batch_the_file_cannot_keep_is_named_as_the_reason(tmp_path: Path) -> None:
    """A streamed batch of the user's own type: the file cannot keep it, and the warning says both (the stream and
    the type); every callback is there, so none is said to be missing."""
    loader = DataLoader(Stream(), batch_size=2, collate_fn=Box)
    said = _warned_on_resume(tmp_path, loader, [], [])
    assert "(its train data is an `IterableDataset`, whose batch is not loaded again, and the checkpoint" in said
    assert "does not hold it (a Box))" in said
    assert "does not have them" not in said
    assert "`ModelCheckpoint(every_n_epochs=1, save_on_train_epoch_end=True)`" in said


def test_a_batch_over_the_size_a_file_keeps_is_named_as_the_reason(tmp_path: Path) -> None:
    said = _warned_on_resume(tmp_path, DataLoader(Stream(), batch_size=2), [], [], keep_batch_bytes=16)
    assert (
        "the checkpoint does not hold it (its tensors hold 40 bytes, over the 16 bytes a checkpoint keeps: raise"
        " `DeterminismCallback(keep_batch_bytes=...)` to 40 bytes or more)"
    ) in said


@pytest.mark.parametrize("keep", [40, 39, 0])
def test_keep_batch_bytes_is_the_largest_batch_kept(tmp_path: Path, keep: int) -> None:
    """A streamed batch of 40 bytes (2 x (4 + 1) float32) is kept up to ``keep_batch_bytes=40``: the resume is exact;
    below, it is not kept, and the resume warns and parts from the uninterrupted run."""
    runs, said = [], []
    for name, resume in (("a", None), ("b", tmp_path / "a" / "ckpt" / CHECKPOINT)):
        model = Teacher()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit_on(tmp_path / name, DataLoader(Stream(), batch_size=2), [], resume, model, keep_batch_bytes=keep)
        said += [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
        runs.append([hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in (model.teacher, model.seen)])
    entry = torch.load(tmp_path / "a" / "ckpt" / CHECKPOINT, weights_only=True)["callbacks"]["DeterminismCallback"]
    kept = "batch" in entry["ranks"][0]["batch_end"]
    assert kept is (keep >= 40)
    assert (runs[0] == runs[1]) is kept
    assert bool(said) is not kept


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("64MiB", TypeError)]
)
def test_bad_keep_batch_bytes_are_refused(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="`keep_batch_bytes` must be"):
        DeterminismCallback(seed=5, keep_batch_bytes=value)


class AfterTheWriter(ModelCheckpoint):
    """A checkpoint callback (Lightning runs those last) after the writer, with its own ``on_train_batch_end``."""

    def __init__(self) -> None:
        super().__init__(save_top_k=0)
        self.seen = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen += 1


def test_a_callback_the_resumed_trainer_lacks_is_named_apart(tmp_path: Path) -> None:
    """The checkpoint names a callback after the writer that the resumed Trainer does not have: said as such, and
    the module's hook, which can be given its batch, is run again (not named)."""
    said = _warned_on_resume(tmp_path, _loader(0), [AfterTheWriter()], [])
    assert "before these callbacks ran that hook (AfterTheWriter{" in said  # its state key
    assert "), and this Trainer does not have them: what they would have done then is missing" in said
    assert "not run again" not in said


def test_the_hook_runs_again_on_every_rank_or_on_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks agree before the hooks run again (they may hold collectives: ``self.log(..., sync_dist=True)``): when
    another rank cannot give them its batch or outputs, this one does not run them either, and says why."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    _fit(tmp_path / "a")
    calls: list[bool] = []

    def another_rank_cannot(self: Any, decision: bool, all: bool = True) -> bool:
        calls.append(decision)
        return False

    monkeypatch.setattr(SingleDeviceStrategy, "reduce_boolean_decision", another_rank_cannot)
    with pytest.warns(NotExactWarning, match=r"not run again on resume \(another rank's batch or outputs cannot be"):
        model, _ = _fit(tmp_path / "b", resume=tmp_path / "a" / "ckpt" / CHECKPOINT)
    assert any(calls)  # this rank could give them again: only the other rank's answer stopped it
    reference, _ = _fit(tmp_path / "c")
    assert not torch.equal(model.teacher, reference.teacher)  # the hook did not run for the checkpoint's batch
