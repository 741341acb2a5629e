"""``ModelPruning`` resumed after a pruning continues bitwise: the entry's ``pruned`` record puts its masks back.

``ModelPruning(make_pruning_permanent=True)`` (its default) writes every checkpoint with ``weight = orig * mask``
and without the mask: a resumed module was not pruned, its masked weights trained again (plain Lightning too). Each
case runs the uninterrupted fit (A, a ``ModelCheckpoint`` every 4 steps, every file kept), then a fit resumed from
one of A's files in another directory (B): B's files (every value of each, compared by ``runner``), the loss of
every step after the checkpoint (its bits) and the final weights must be A's. The model trains with SGD, momentum
and weight decay (so the original values under a mask keep moving, as the file does not hold them), 8 batches an
epoch, pruned at every epoch's end: L1 over the whole model (ranking by the tensor the last forward computed),
per layer, random, with the lottery-ticket reset (``ModelPruning``'s default) or without.
"""

from __future__ import annotations

import json
import logging
import struct
import warnings
from pathlib import Path
from typing import Any

import helpers
import lightning
import lightning.pytorch as pl
import pytest
import runner
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelPruning
from packaging.version import Version
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback, NotExactWarning, digest_tensors
from lightning_repro._warn import RESUME_LOGGER
from lightning_repro.checkpoint.pruned import check_records, give_back, pruned_tensors
from lightning_repro.checkpoint.seal import DIGEST_KEY, seal_entry
from lightning_repro.cli.main import main

EVERY = 4  # ModelCheckpoint(every_n_train_steps=4): steps 4, 8, 12 ... (8 batches an epoch: 8, 16 on its last batch)
RESET_SHARES_STORAGE = Version(lightning.__version__) >= Version("2.6")
IGNORED = ("/callbacks/DeterminismCallback/manifest/code/", "/callbacks/DeterminismCallback/entry_sha256")


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


class Losses(Callback):
    """The bits of every step's loss, by global step."""

    def __init__(self) -> None:
        self.by_step: dict[int, str] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.by_step[trainer.global_step] = struct.pack(">f", float(outputs["loss"])).hex()


def _loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(data, batch_size=8, shuffle=True)


PRUNINGS: dict[str, dict[str, Any]] = {
    "l1-global": {"pruning_fn": "l1_unstructured", "amount": 0.25},
    "l1-per-layer": {"pruning_fn": "l1_unstructured", "amount": 0.25, "use_global_unstructured": False},
    "random": {"pruning_fn": "random_unstructured", "amount": 0.25, "use_lottery_ticket_hypothesis": False},
}


def _fit(root: Path, pruning: str, caplog: pytest.LogCaptureFixture, resume: Path | None = None) -> dict[str, Any]:
    losses = Losses()
    callbacks: list[Callback] = [
        DeterminismCallback(seed=3),
        ModelPruning(**PRUNINGS[pruning], verbose=0),
        losses,
        ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=EVERY, save_top_k=-1),
    ]
    model = Model()  # built after the callback seeded
    trainer = helpers.fast_trainer(callbacks, max_epochs=3, default_root_dir=root, enable_checkpointing=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=RESUME_LOGGER), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(), ckpt_path=resume)
    return {
        "weights": digest_tensors(dict(model.state_dict())),
        "losses": losses.by_step,
        "said": [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)],
        "line": "".join(r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()),
    }


def _file(root: Path, step: int) -> Path:
    [path] = Path(root, "ckpt").glob(f"*-step={step}.ckpt")
    return path


def _assert_resumes(tmp_path: Path, pruning: str, step: int, caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """Run A, resume B from A's file of ``step``; assert B left A's files, losses and weights; A's entry there."""
    a = _fit(tmp_path / "a", pruning, caplog)
    assert a["said"] == [], a["said"]
    resumed_from = _file(tmp_path / "a", step)
    b = _fit(tmp_path / "b", pruning, caplog, resume=resumed_from)
    assert b["said"] == [], b["said"]
    assert ": exact" in b["line"], b["line"]
    later = sorted(p.name for p in Path(tmp_path, "a", "ckpt").glob("*.ckpt") if int(p.stem.split("=")[-1]) > step)
    problems = runner.compare_checkpoint_files(tmp_path / "a", tmp_path / "b", ignore=IGNORED, names=later)
    assert not problems, "\n".join(problems)
    assert b["losses"] == {s: bits for s, bits in a["losses"].items() if s > step}
    assert b["weights"] == a["weights"]
    return torch.load(resumed_from, weights_only=True)["callbacks"]["DeterminismCallback"]


@pytest.mark.parametrize("pruning", list(PRUNINGS))
def test_a_resume_after_a_pruning_continues_bitwise(
    tmp_path: Path, pruning: str, caplog: pytest.LogCaptureFixture
) -> None:
    entry = _assert_resumes(tmp_path, pruning, 12, caplog)  # epoch 1, pruned once at epoch 0's end
    records = entry["pruned"]
    tensors = [(module, name) for module in ("net.0", "net.3") for name in ("weight", "bias")]  # ModelPruning's default
    assert [(r["module"], r["name"]) for r in records] == tensors
    assert check_records(records)
    assert all(r["mask"].dtype == torch.bool for r in records)
    assert 0 < sum(int((~r["mask"]).sum()) for r in records) < sum(r["mask"].numel() for r in records)
    # written at a batch's end: the optimizer stepped since its forward computed `weight`, which is recorded
    assert any("current" in r for r in records)
    # Lightning 2.6's reset assigns `weight_orig.data` (shared from then on); 2.5's assigned the recomputed `weight`
    lottery = PRUNINGS[pruning].get("use_lottery_ticket_hypothesis", True) and RESET_SHARES_STORAGE
    assert all(r.get("lottery_shared", False) is lottery for r in records)


def test_a_resume_on_an_epochs_last_batch_keeps_the_tensor_the_global_ranking_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 16 is epoch 1's last batch: the resumed run prunes at once, before any forward, ranking the weights by
    the ``weight`` the last forward computed (before that batch's optimizer step), which the entry holds."""
    entry = _assert_resumes(tmp_path, "l1-global", 16, caplog)
    assert any("current" in r for r in entry["pruned"])


def test_inspect_lists_the_pruned_tensors(tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: Any) -> None:
    _fit(tmp_path, "l1-per-layer", caplog)
    capsys.readouterr()
    assert main(["inspect", str(_file(tmp_path, 12))]) == 0
    shown = "4 tensor(s) pruned by ModelPruning, pruned again on resume: net.0.weight, net.0.bias, net.3.weight, net.3."
    assert shown in capsys.readouterr().out
    assert main(["inspect", str(_file(tmp_path, 4)), "--json"]) == 0  # before the first pruning
    assert json.loads(capsys.readouterr().out)["pruned_tensors"] == []


def test_an_entry_before_the_first_pruning_records_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    entry = _assert_resumes(tmp_path, "l1-global", 4, caplog)
    assert "pruned" not in entry


def test_an_entry_without_the_record_says_modelpruning_is_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint of an earlier lightning-repro (no ``pruned``): the resume warns, naming ModelPruning, and is not
    exact (the masked weights train again)."""
    a = _fit(tmp_path / "a", "l1-global", caplog)
    path = _file(tmp_path / "a", 12)
    checkpoint = torch.load(path, weights_only=True)
    entry = checkpoint["callbacks"]["DeterminismCallback"]
    del entry["pruned"], entry[DIGEST_KEY]
    seal_entry(entry)
    torch.save(checkpoint, tmp_path / "older.ckpt")
    b = _fit(tmp_path / "b", "l1-global", caplog, resume=tmp_path / "older.ckpt")
    assert b["weights"] != a["weights"]
    [message] = [m for m in b["said"] if "parameters" in m]
    assert "this checkpoint's entry holds no record of them to prune the resumed module again" in message
    assert ": NOT exact: " in b["line"]


def test_a_record_that_does_not_fit_the_module_is_refused_whole() -> None:
    pruned = nn.Sequential(nn.Linear(4, 3))
    torch.nn.utils.prune.random_unstructured(pruned[0], "weight", amount=0.5)
    records = pruned_tensors(pruned)
    assert records is not None
    assert check_records(records)
    other = nn.Sequential(nn.Linear(4, 5))
    before = digest_tensors(dict(other.state_dict()))
    why = give_back(other, records, rank=0)
    assert why is not None
    assert "0.weight has shape (5, 4), its mask (3, 4)" in why
    assert give_back(nn.Sequential(), records, rank=0) is not None
    assert digest_tensors(dict(other.state_dict())) == before  # nothing changed
    fresh = nn.Sequential(nn.Linear(4, 3))
    assert give_back(fresh, records, rank=0) is None
    assert digest_tensors(dict(fresh.state_dict())) != before
    assert torch.equal(fresh[0].weight_mask, pruned[0].weight_mask)


def test_malformed_records_are_found() -> None:
    good = {"module": "net.0", "name": "weight", "mask": torch.tensor([True, False]), "masked": torch.tensor([1.0])}
    assert check_records([good])
    assert not check_records([{**good, "masked": torch.tensor([1.0, 2.0])}])  # one value under one masked entry
    assert not check_records([{**good, "module": 0}])
    assert not check_records([{**good, "current": [1.0]}])
    assert not check_records(good)


@pytest.mark.slow
def test_a_killed_run_resumed_in_a_fresh_process_leaves_the_uninterrupted_runs_files(runs: Any) -> None:
    """``tests/scenario.py`` (a LightningDataModule-like setup: validation, AdamW with weight decay, a scheduler,
    metrics, dropout, 2 workers), L1 pruning over the whole model with the lottery-ticket reset, a ModelCheckpoint
    every 5 steps with ``last.ckpt``; SIGKILLed 2 batches after step 15 (epoch 1, pruned once), resumed from
    ``last.ckpt`` in a fresh process in the same folder: every file it keeps is the uninterrupted run's."""
    cfg = {"pruning": "l1", "ckpt_every_n_steps": 5, "save_last": True, "max_epochs": 3, "num_workers": 2}
    reference, ref_out = runs.reference(cfg)
    _, out = runs.run({**cfg, "kill_after_batches": 17}, "pruned-killed", expect_kill=True)
    last = Path(out, "ckpt", "last.ckpt")
    assert runner.checkpoint_position(last)[:2] == (15, 15)
    assert torch.load(last, weights_only=True)["callbacks"]["DeterminismCallback"]["pruned"]
    resumed = runner.run({**cfg, "out": out, "resume": str(last)})
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)
    for key in ("params", "optimizer", "global_step", "epoch"):
        assert resumed[key] == reference[key], key
    assert ": exact (restore verified: parameters, optimizer" in resumed["stderr"]
