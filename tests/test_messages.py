"""What the user sees: warnings at the user's line, none for an exact case, one line per resume saying exact or not.

In process (a resume here is an in-process ``fit(ckpt_path=...)``: these tests check what is said; the bitwise
resumes of the same cases in fresh processes are in ``test_resume.py``).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import re
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from lightning_repro import DeterminismCallback, NondeterminismWarning, NotExactWarning, seeding
from lightning_repro._warn import RESUME_LOGGER, WarningCache, warn

PACKAGE = Path(__file__).parents[1] / "lightning_repro"


class Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _tensors(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class Stream(IterableDataset):  # type: ignore[type-arg]
    """16 fixed samples, no state, no length."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = _tensors(16)
        start, self.position = self.position, 0
        for i in range(start, 16):
            self.position = i + 1
            yield data[i]


class StatefulStream(Stream):
    """Its position as ``state_dict()``."""

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


class SizedStatefulStream(StatefulStream):
    def __len__(self) -> int:
        return 16


class Batches:
    """An iterable of batches that is not a DataLoader."""

    def __iter__(self) -> Iterator[Any]:
        return iter(DataLoader(_tensors(), batch_size=4))


def _trainer(*callbacks: Any, **kwargs: Any) -> pl.Trainer:
    return helpers.fast_trainer(callbacks, limit_val_batches=0, **kwargs)


@pytest.fixture
def lines() -> Iterator[list[str]]:
    """What the resume logger passes to Lightning's handler (shown by default; the fixture only listens)."""
    logger = logging.getLogger(RESUME_LOGGER)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def _resume_lines(seen: list[str]) -> list[str]:
    return [line for line in seen if line.startswith("lightning-repro: resumed from")]


# ---------------------------------------------------------------------------------------------- 5: the user's line
def _ours(caught: list[warnings.WarningMessage], category: type[Warning] = NotExactWarning) -> list[Any]:
    return [w for w in caught if issubclass(w.category, category)]


def test_the_hash_seed_warning_points_at_the_line_that_constructs_the_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seeding, "_INTERPRETER_HASH_SEED", None)
    monkeypatch.setattr(seeding, "_warned_hash_seed", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        DeterminismCallback(seed=5)
    [warning] = _ours(caught, NondeterminismWarning)
    assert "PYTHONHASHSEED is not set" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_a_takeover_warning_during_fit_points_at_the_fit_call() -> None:
    callback = DeterminismCallback(seed=5)
    trainer = _trainer(callback, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        trainer.fit(Small(), Batches())
    [warning] = _ours(caught)
    assert "cannot take over a Batches (not a torch DataLoader)" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)


@pytest.fixture
def foreign_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint written by plain Lightning (no lightning-repro entry), after 3 of 8 batches."""
    path = tmp_path / "plain.ckpt"
    trainer = _trainer(max_steps=3)
    trainer.fit(Small(), DataLoader(_tensors(), batch_size=4))
    trainer.save_checkpoint(path)
    return path


def test_a_resume_warning_points_at_the_fit_call(foreign_checkpoint: Path) -> None:
    trainer = _trainer(DeterminismCallback(seed=5), max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        trainer.fit(Small(), DataLoader(_tensors(), batch_size=4), ckpt_path=foreign_checkpoint)
    [warning] = _ours(caught)
    assert "The checkpoint has no lightning-repro entry" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_without_a_user_frame_the_warning_points_at_lightning_repro(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread (as a dataloader worker) has no frame of the user's: the line of lightning-repro that warned."""
    monkeypatch.setattr(seeding, "_INTERPRETER_HASH_SEED", None)
    monkeypatch.setattr(seeding, "_warned_hash_seed", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread = threading.Thread(target=seeding.check_hash_seed, args=(5,))
        thread.start()
        thread.join()
    [warning] = _ours(caught, NondeterminismWarning)
    assert warning.filename == str(PACKAGE / "seeding.py")


def test_filtering_by_category_works_and_other_ranks_stay_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    def given(**filters: Any) -> list[Any]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if filters:
                warnings.filterwarnings("ignore", **filters)
            WarningCache().warn("lost", category=NotExactWarning)
        return _ours(caught)

    assert len(given()) == 1  # so the filter below has something to remove
    assert given(category=NotExactWarning) == []
    assert given(category=NondeterminismWarning) != []
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert given() == []


def test_every_warning_of_the_package_goes_through_the_one_helper() -> None:
    """``rank_zero_warn``, ``warnings.warn`` or Lightning's ``WarningCache`` would point into Lightning."""
    pattern = re.compile(r"rank_zero_warn|(?<![\w.])warnings\.warn|from (?!lightning_repro)\S+ import .*WarningCache")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_warn.py":
            continue
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(text):
                found.append(f"{path.name}:{number}: {text.strip()}")
    assert found == []


def test_warn_is_attributed_to_the_caller_of_the_package() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        warn("direct", NotExactWarning)
    assert [(w.filename, w.lineno) for w in _ours(caught)] == [(__file__, line)]


# ---------------------------------------------------------------------------------------------- 6: exact, no warning
@pytest.mark.parametrize(
    "sampler",
    [
        lambda: WeightedRandomSampler(torch.linspace(1, 2, 32), num_samples=32, replacement=True),
        lambda: RandomSampler(range(32), replacement=True),
    ],
    ids=["weighted", "random-with-replacement"],
)
def test_a_sampler_seeded_through_its_generator_gets_an_info_line_not_a_warning(
    sampler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    callback = DeterminismCallback(seed=5)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, "lightning_repro.data.takeover"):
        warnings.simplefilter("always")
        for _ in range(2):  # said once per callback
            _trainer(callback, max_epochs=2).fit(Small(), DataLoader(_tensors(), batch_size=4, sampler=sampler()))
    assert [w for w in caught if "lightning_repro" in w.category.__module__] == []
    [line] = [r.getMessage() for r in caplog.records if r.name == "lightning_repro.data.takeover"]
    assert "is seeded through its `generator` attribute (checked" in line
    assert line.endswith("(indices only, no data is loaded): exact.")


def test_a_sampler_whose_order_does_not_replay_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    import os

    class Urandom(RandomSampler):
        def __iter__(self) -> Iterator[int]:
            yield from sorted(range(32), key=lambda _: os.urandom(4))

    with pytest.warns(NotExactWarning, match="Urandom is not a sampler lightning-repro knows: two passes from the"):
        helpers.prepare(DataLoader(_tensors(), batch_size=4, sampler=Urandom(range(32))))


def test_the_info_line_is_rank_zero_only(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    said = []
    for rank in (0, 1):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        caplog.clear()
        with caplog.at_level(logging.INFO, "lightning_repro.data.takeover"):
            helpers.prepare(DataLoader(_tensors(), batch_size=4, sampler=RandomSampler(range(32), replacement=True)))
        said.append(len([r for r in caplog.records if r.name == "lightning_repro.data.takeover"]))
    assert said == [1, 0]


def test_ranks_are_named_in_spans() -> None:
    from lightning_repro._warn import ranks_text

    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 1]) == "ranks 1, 2"
    assert ranks_text(range(1, 64)) == "ranks 1-63"
    assert ranks_text([7, 0, 2, 5, 6, 9, 10, 2]) == "ranks 0, 2, 5-7, 9, 10"


def test_a_note_several_ranks_share_is_given_once_with_their_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's line under DDP gives each other rank's note it lacks; a note of 63 ranks (a node's drift, say) is one
    note naming them, not 63 (it was one note per rank)."""
    from lightning_repro.data import resumeline

    drift = "The environment changed since the checkpoint was written: hostname"
    gathered = [["rank 0's own"], [f"[rank 1] {drift}", "only 1"], *[[drift, "rank 0's own"]] * 61, [drift]]
    monkeypatch.setattr(resumeline, "from_every_rank", lambda notes, world_size: gathered)
    assert resumeline.every_rank_notes(["rank 0's own"], 64) == [
        "rank 0's own",
        f"[ranks 1-63] {drift}",
        "[rank 1] only 1",
    ]
    monkeypatch.setattr(resumeline, "from_every_rank", lambda notes, world_size: None)
    assert resumeline.every_rank_notes(["a"], 1) == ["a"]


# ---------------------------------------------------------------------------------------------- 7, 8: the resume line
def _saved(tmp_path: Path, loader: Any, steps: int = 3) -> Path:
    path = tmp_path / "repro.ckpt"
    trainer = _trainer(DeterminismCallback(seed=5), max_steps=steps)
    trainer.fit(Small(), loader())
    trainer.save_checkpoint(path)
    return path


def _resumed(path: Path, loader: Any, **callback: Any) -> pl.Trainer:
    trainer = _trainer(DeterminismCallback(seed=5, **callback), max_steps=6)
    trainer.fit(Small(), loader(), ckpt_path=path)
    return trainer


def _map() -> DataLoader[Any]:
    return DataLoader(_tensors(), batch_size=4, shuffle=True)


def test_an_exact_resume_says_so_in_one_line(tmp_path: Path, lines: list[str]) -> None:
    path = _saved(tmp_path, _map)
    assert _resume_lines(lines) == []  # nothing said on a fresh fit
    _resumed(path, _map)
    [line] = _resume_lines(lines)
    assert line == (
        f"lightning-repro: resumed from {path} at step 3, epoch 0: exact (restore verified: parameters, optimizer,"
        " lr_schedulers, process streams, data position, metric states; data: O(1) skip of 3 batches)"
    )
    assert not [x for x in lines if "continuation" in x]  # no trace: no second line


def test_a_resume_from_a_checkpoint_without_our_entry_says_not_exact(
    foreign_checkpoint: Path, lines: list[str]
) -> None:
    with pytest.warns(NotExactWarning, match="no lightning-repro entry"):
        _resumed(foreign_checkpoint, lambda: DataLoader(_tensors(), batch_size=4))
    [line] = _resume_lines(lines)
    # plain Lightning's counters: the epoch max_steps cut short counts as finished
    assert line.startswith(f"lightning-repro: resumed from {foreign_checkpoint} at step 3, epoch 1: NOT exact: ")
    assert "NOT exact: The checkpoint has no lightning-repro entry (it was written without DeterminismCallback" in line


def test_ignoring_the_entry_says_not_exact(tmp_path: Path, lines: list[str]) -> None:
    path = _saved(tmp_path, _map)
    with pytest.warns(NotExactWarning, match="ignore_checkpoint_state=True"):
        _resumed(path, _map, ignore_checkpoint_state=True)
    [line] = _resume_lines(lines)
    assert ": NOT exact: DeterminismCallback(ignore_checkpoint_state=True)" in line


@pytest.mark.parametrize(
    ("dataset", "exact", "said"),
    [
        (Stream, True, "Stream: position restored at 8 items (a fast-forward of 8 items)"),
        (StatefulStream, True, "StatefulStream: position restored at 8 items (the dataset's state)"),
        (SizedStatefulStream, True, "SizedStatefulStream: position restored at 8 items (the dataset's state)"),
    ],
    ids=["no-state", "state-no-len", "state-len"],
)
def test_a_mid_epoch_resume_of_an_iterable_says_exact_only_when_it_is(
    tmp_path: Path, lines: list[str], dataset: Any, exact: bool, said: str
) -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=4)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = _saved(tmp_path, loader, steps=2)
        _resumed(path, loader)
    [line] = _resume_lines(lines)
    assert (": exact (" in line) is exact
    assert (": NOT exact: the data position is not restored exactly" in line) is not exact
    assert f"data: {said}" in line
    ours = [str(w.message) for w in _ours(caught)]
    if exact:
        assert ours == []
        assert not [x for x in lines if "so the resume is exact" in x]
    else:  # the warning at the takeover says the same
        assert any(said.split(" ")[0] in message for message in ours), ours


class Curriculum(pl.LightningDataModule):
    """Epoch 1 trains on 28 samples (7 batches), the others on 32 (8); the scheduler sized by
    ``estimated_stepping_batches``, which builds the train loader before the checkpoint is restored."""

    def __init__(self, shrink: int = 0) -> None:
        super().__init__()
        self.shrink = shrink

    def train_dataloader(self) -> DataLoader[Any]:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        n = 32 - 4 * (epoch % 2) - self.shrink
        return DataLoader(torch.utils.data.Subset(_tensors(), range(n)), batch_size=4, shuffle=True)


class Scheduled(Small):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total)}


@pytest.mark.parametrize(
    ("reload", "shrink", "lengths"),
    [(1, 0, None), (1, 4, (6, 7)), (0, 4, (7, 8))],
    ids=["reloaded-exact", "reloaded-another-length", "built-once-another-length"],
)
def test_a_loader_built_before_the_restore_is_judged_by_the_loader_in_use(
    tmp_path: Path, lines: list[str], reload: int, shrink: int, lengths: tuple[int, int] | None
) -> None:
    """``reload_dataloaders_every_n_epochs=1`` and a loader whose length changes with the epoch: the scheduler's
    ``estimated_stepping_batches`` builds epoch 0's loader before the restore, then Lightning builds the resumed
    epoch's. The resume is exact, and was said NOT exact ("has 8 batches per epoch now but had 7"), from the loader
    built first. A resumed epoch whose loader does have another length is still said (4 samples fewer), the loader
    built again or (no reload) the one built before the restore."""
    path = tmp_path / "mid.ckpt"
    callbacks = (DeterminismCallback(seed=5), helpers.SaveAt(path, (1, 3)))
    trainer = _trainer(*callbacks, max_epochs=2, reload_dataloaders_every_n_epochs=reload)
    trainer.fit(Scheduled(), datamodule=Curriculum())
    lines.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _trainer(DeterminismCallback(seed=5), max_epochs=2, reload_dataloaders_every_n_epochs=reload)
        resumed.fit(Scheduled(), datamodule=Curriculum(shrink), ckpt_path=path)
    said = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
    [line] = [line for line in lines if "resumed from" in line]
    if lengths:
        assert said == [
            f"Train dataloader 0 has {lengths[0]} batches per epoch now but had {lengths[1]} when the checkpoint was"
            " written: the data position cannot be restored exactly."
        ]
        assert f": NOT exact: Train dataloader 0 has {lengths[0]} batches" in line, line
    else:
        assert said == []
        assert ": exact (" in line, line


def test_a_warning_from_a_frame_whose_loader_has_no_source_still_warns() -> None:
    """A ``python -c`` process (a fork server's ``__main__``) has ``BuiltinImporter`` as its ``__loader__``.

    Handing its globals to ``warnings.warn_explicit`` made the warning itself raise ``ImportError`` (seen in
    ``assert_resume_bitwise``'s fork-server children, where PYTHONHASHSEED is unset).
    """
    import importlib.machinery

    namespace = {"__name__": "__main__", "__loader__": importlib.machinery.BuiltinImporter}
    namespace.update(warn=warn, NotExactWarning=NotExactWarning)
    code = compile("warn('from a -c process', NotExactWarning)", "<string>", "exec")
    with pytest.warns(NotExactWarning, match="from a -c process") as record:
        exec(code, namespace)
    assert record[0].filename == "<string>"


class SavesInFlight(Small):
    """Saves in the middle of a training batch (``where``), or at its end (``on_train_batch_end``: not in flight).

    ``kind``: ``"batchnorm"`` (a BatchNorm's statistics move in the forward), ``"metric"`` (a torchmetrics metric
    updated before the save), ``"manual"`` (manual optimization), else the plain model.
    """

    def __init__(self, path: Path | None, where: str, kind: str = "") -> None:
        super().__init__()
        self.path, self.where, self.kind = path, where, kind
        if kind == "batchnorm":
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        if kind == "metric":
            import torchmetrics

            self.mean = torchmetrics.MeanMetric()
        self.automatic_optimization = kind != "manual"

    def _save(self, hook: str, batch_idx: int) -> None:
        if self.path is not None and hook == self.where and batch_idx == 1:
            self.trainer.save_checkpoint(self.path)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._save("on_train_batch_start", batch_idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.kind == "metric":
            self.mean.update(loss.detach())
        self._save("training_step", batch_idx)
        if self.kind == "manual":
            self.manual_backward(loss)
            self.optimizers().step()  # type: ignore[union-attr]
            self.optimizers().zero_grad()  # type: ignore[union-attr]
        return loss

    def on_after_backward(self) -> None:
        self._save("on_after_backward", self.trainer.fit_loop.epoch_loop.batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._save("on_train_batch_end", batch_idx)


@pytest.mark.parametrize(
    ("where", "kind", "why"),
    [
        ("on_train_batch_start", "", None),
        ("training_step", "", None),
        ("on_train_batch_end", "", None),  # not in flight: Lightning counted the batch processed
        ("on_after_backward", "", "in `on_after_backward`, after `training_step`: the backward or the optimizer step"),
        ("training_step", "batchnorm", "a buffer of the model (BatchNorm's running statistics, say) was updated"),
        ("training_step", "metric", "a torchmetrics metric was updated in the batch"),
        ("training_step", "manual", "in `training_step` under manual optimization"),
    ],
    ids=["batch-start", "training_step", "batch-end", "after-backward", "batchnorm", "metric", "manual"],
)
def test_a_checkpoint_written_inside_a_batch_says_whether_it_is_exact(
    where: str, kind: str, why: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Inside a batch, before anything a checkpoint cannot take back changed, the file resumes at the batch's start
    (exact, no warning); after the backward, a moved BatchNorm, an updated metric or under manual optimization it
    says NOT exact, and why. Before, every checkpoint inside a batch was said NOT exact (and skipped the batch)."""
    path = tmp_path / "in-batch.ckpt"
    data = DataLoader(_tensors(), batch_size=4, shuffle=True)
    helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=3, default_root_dir=tmp_path).fit(
        SavesInFlight(path, where, kind), data
    )
    entry = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]
    trainer = helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=5, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(SavesInFlight(None, where, kind), data, ckpt_path=path)
    in_flight = [w for w in seen if "in the middle of training batch 1" in str(w.message)]
    line = next(r.getMessage() for r in caplog.records if "resumed from" in r.getMessage())
    if why is None:
        assert not in_flight, [str(w.message) for w in in_flight]
        assert ": exact (" in line, line
        rewound = {"batch": 1, "exact": True, "why": ""}
        assert entry.get("in_flight") == (None if where == "on_train_batch_end" else rewound)
    else:
        assert len(in_flight) == 1
        assert issubclass(in_flight[0].category, NotExactWarning)
        assert why in str(in_flight[0].message), str(in_flight[0].message)
        assert ": NOT exact: The checkpoint was written in the middle of training batch 1" in line, line
        assert entry["in_flight"]["exact"] is False


class Validated(Small):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))


@pytest.mark.parametrize("min_epochs", [None, 4], ids=["stopped", "min-epochs-not-met"])
def test_a_checkpoint_of_a_run_asked_to_stop_says_the_resume_trains_on(tmp_path: Path, min_epochs: int | None) -> None:
    """EarlyStopping stops at the second validation; a checkpoint is written then, and the job ends (preempted in
    teardown, or run again with ``ckpt_path="last"``). Lightning saves no ``should_stop``: the resume trains on, and
    said "exact". With ``min_epochs`` not met the run did not stop there: nothing to say."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    def fit(ckpt: Path | None) -> pl.Trainer:
        stop = EarlyStopping("val_loss", patience=0, min_delta=100.0)  # no validation improves on the first
        last = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=-1)
        options = {"max_epochs": 6, "min_epochs": min_epochs, "enable_checkpointing": True}
        trainer = helpers.fast_trainer([DeterminismCallback(3), stop, last], default_root_dir=tmp_path, **options)
        loader = DataLoader(_tensors(), batch_size=8, shuffle=True)
        trainer.fit(Validated(), loader, DataLoader(_tensors(8), batch_size=8), ckpt_path=ckpt)
        return trainer

    first = fit(None)
    assert first.current_epoch == (2 if min_epochs is None else 4)
    # the second validation's (epoch 1): the run stopped there, or went on to min_epochs
    (tmp_path / "ckpt" / "epoch=1-step=8.ckpt").rename(tmp_path / "stopped.ckpt")
    shutil.rmtree(tmp_path / "ckpt")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fit(tmp_path / "stopped.ckpt")
    stop_said = [str(w.message) for w in said if "had been asked to stop" in str(w.message)]
    if min_epochs is None:
        assert stop_said == [
            "The interrupted run had been asked to stop when this checkpoint was written (`trainer.should_stop`, set"
            " by EarlyStopping, a Timer or the module): it ended there, but Lightning saves no stop request, so the"
            " resumed run trains on (as it would without lightning-repro)."
        ]
    else:
        assert stop_said == []


def test_a_resume_into_another_checkpoint_folder_says_its_callback_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run folder moved (or a new one given): Lightning gives ModelCheckpoint back none of its state there (its
    own warning says so), so the files it keeps differ from the uninterrupted run's. The training does not: the line
    stays "exact" and says the callback starts afresh (it said "exact" alone); in the same folder nothing is said."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(folder: str, ckpt: Path | None) -> str | None:
        saves = ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=2, save_top_k=-1)
        options = {"max_steps": 4 if ckpt is None else 6, "enable_checkpointing": True}
        trainer = helpers.fast_trainer([DeterminismCallback(3), saves], default_root_dir=tmp_path, **options)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The dirpath has changed")  # Lightning's own
            warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
            trainer.fit(Small(), DataLoader(_tensors(), batch_size=8, shuffle=True), ckpt_path=ckpt)
        return next((r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()), None)

    assert fit("run", None) is None
    same = fit("run", tmp_path / "run" / "epoch=0-step=2.ckpt")
    assert same is not None
    assert ": exact (" in same, same
    assert "afresh" not in same, same
    moved = fit("moved", tmp_path / "run" / "epoch=0-step=2.ckpt")
    assert moved is not None
    assert ": exact (" in moved, moved
    assert (
        f"; ModelCheckpoint in {tmp_path / 'moved'} starts afresh: its files kept and best scores are not given back"
        f" outside the checkpoint's dirpath {tmp_path / 'run'})"
    ) in moved, moved


class NoValidation(Small):
    def validation_step(self, batch: Any, batch_idx: int) -> None:  # pragma: no cover - never called
        raise AssertionError("no validation loader")

    def val_dataloader(self) -> list[Any]:
        return []  # Lightning's "no validation"


def test_an_empty_val_dataloader_list_gets_no_warning(tmp_path: Path) -> None:
    """``val_dataloader()`` returning ``[]`` (Lightning reads it as no validation): the run is exact, and got a
    ``NotExactWarning`` ("cannot take over a list ... not exact") at every fit."""
    trainer = helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=2, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(NoValidation(), DataLoader(_tensors(), batch_size=8, shuffle=True))
    ours = [str(w.message) for w in seen if issubclass(w.category, (NotExactWarning, NondeterminismWarning))]
    assert ours == []
    assert trainer.global_step == 2


def test_a_train_loader_resumed_with_another_order_is_said_not_exact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Written 2 batches into a shuffled epoch, resumed with ``shuffle=False``: the same number of batches, so the
    length check said nothing, and the line said exact (the 2 batches skipped are not those consumed)."""
    first = helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=2, default_root_dir=tmp_path)
    first.fit(Small(), DataLoader(_tensors(), batch_size=8, shuffle=True))
    first.save_checkpoint(tmp_path / "two.ckpt")
    trainer = helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=4, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(Small(), DataLoader(_tensors(), batch_size=8, shuffle=False), ckpt_path=tmp_path / "two.ckpt")
    said = [str(w.message) for w in seen if issubclass(w.category, NotExactWarning)]
    assert said == [
        "Train dataloader 0 orders its data otherwise than when the checkpoint was written (kind 'random' ->"
        " 'sequential'): the batches skipped would not be those consumed, so the data position cannot be restored"
        " exactly."
    ], said
    line = next(r.getMessage() for r in caplog.records if "resumed from" in r.getMessage())
    assert ": NOT exact: Train dataloader 0 orders its data otherwise" in line, line


class _Seen(Small):
    """Small that notes each batch's first sample (which samples a step consumed)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(hashlib.sha256(batch[0].numpy().tobytes()).hexdigest())
        return super().training_step(batch, batch_idx)


def _own_sampler_loader(seed: int) -> DataLoader[Any]:
    data = _tensors()
    return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=seed))


def test_a_user_s_distributed_sampler_seed_orders_the_run_and_a_change_of_it_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's ``DistributedSampler(seed=7)`` and ``seed=8`` gave one run (the seed was overwritten); now each its
    own, a resume continues the seed's order exactly, and a resume with the other seed says NOT exact."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    runs = {}
    for seed in (7, 8):
        module = _Seen()
        helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=4).fit(module, _own_sampler_loader(seed))
        runs[seed] = module.seen
    assert runs[7] != runs[8]
    first = helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=2, default_root_dir=tmp_path)
    first.fit(_Seen(), _own_sampler_loader(7))
    first.save_checkpoint(tmp_path / "two.ckpt")
    resumed = _Seen()
    trainer = helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=4, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotExactWarning)
        trainer.fit(resumed, _own_sampler_loader(7), ckpt_path=tmp_path / "two.ckpt")
    assert resumed.seen == runs[7][2:]
    trainer = helpers.fast_trainer([DeterminismCallback(seed=1)], max_steps=4, default_root_dir=tmp_path)
    with pytest.warns(NotExactWarning, match=r"orders its data otherwise .*\(sampler_seed 7 -> 8\)"):
        trainer.fit(_Seen(), _own_sampler_loader(8), ckpt_path=tmp_path / "two.ckpt")
