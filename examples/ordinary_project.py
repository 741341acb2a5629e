"""An ordinary Lightning project, and what a kill + resume does to it with and without lightning-repro.

The project is written the way most Lightning projects are:

* a ``LightningDataModule`` with augmentation in ``Dataset.__getitem__`` (torch, numpy and python
  ``random``), a shuffled train loader with worker processes, and validation loaders;
* a classifier with dropout, torchmetrics logged ``on_epoch=True`` in training and validation;
* ``OneCycleLR`` stepped every batch and sized by ``self.trainer.estimated_stepping_batches``
  (or ``ReduceLROnPlateau`` on ``val_loss``);
* validation twice per epoch (``val_check_interval=0.5``), ``ModelCheckpoint(monitor="val_loss",
  save_top_k=2, save_last=True, every_n_train_steps=...)``, a second ``ModelCheckpoint`` by epoch,
  ``EarlyStopping`` on ``val_loss``, a ``CSVLogger`` and a JSON-lines logger of its own (every logged row).

Run it as a demo (about a minute on 2 CPU cores)::

    python examples/ordinary_project.py

It trains the project three times in fresh processes, with plain Lightning and with
``DeterminismCallback``: (a) uninterrupted, (b) killed hard (``os._exit``) a few steps after
``last.ckpt`` was written in the middle of an epoch, (c) resumed from ``last.ckpt``. It then compares
(c) with (a): the final weights, optimizer and scheduler states, every value the loggers received
after the checkpoint, the files ``ModelCheckpoint`` keeps and its best score, and ``EarlyStopping``'s
state. Exit code 0 when the lightning-repro resume equals its uninterrupted run in all of them.

The test suite runs the same project with other settings (``--run CONFIG_JSON``, see ``DEFAULTS``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torchmetrics
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, Dataset

KILLED_EXIT_CODE = 17

DEFAULTS: dict[str, Any] = {
    "out": "",
    "repro": True,  # DeterminismCallback, else plain Lightning with seed_everything(workers=True)
    "seed": 7,
    "samples": 192,
    "batch_size": 16,  # 12 batches per epoch
    "num_workers": 2,
    "max_epochs": 4,
    "max_steps": -1,
    "val_check_interval": 0.5,  # a fraction of the epoch, or an int (every N batches)
    "check_val_every_n_epoch": 1,
    "val_loaders": 1,
    "scheduler": "onecycle",  # "onecycle" (per step, sized by estimated_stepping_batches) | "plateau"
    "every_n_train_steps": 5,  # the monitored ModelCheckpoint (+ last.ckpt); 0: none
    "every_n_epochs": 1,  # a second ModelCheckpoint by epoch; 0: none
    "monitor_every_n_epochs": 0,  # the monitored ModelCheckpoint by epoch instead of by step (0: by step)
    "save_on_train_epoch_end": None,  # of the epoch ModelCheckpoint
    "early_stopping": True,
    "accumulate": 1,  # accumulate_grad_batches
    "teacher": False,  # the module moves an EMA teacher in its own on_train_batch_end and logs it (BYOL, DINO)
    "kill_after_batches": 0,  # os._exit after this many training batches of this process (0: never)
    "kill_at_file": "",  # os._exit right after ModelCheckpoint wrote this file: "NAME@GLOBAL_STEP"
    "save_from_hook_at_step": 0,  # trainer.save_checkpoint(out/hook.ckpt) in on_train_batch_end at this step
    "save_at_end": "",  # trainer.save_checkpoint(path) after fit
    "resume": "",  # ckpt_path: a path, or "last" for <out>/ckpt/last.ckpt
    "deterministic": True,
    "tag": "run",  # the record of this run: <out>/record-<tag>.jsonl
    "trace": False,  # DeterminismCallback(trace=True, on_divergence="error"): traces beside the checkpoints, checked
    "stream": "",  # a directory: the data streamed with litdata from chunks there (examples/streamed_points.py)
}


# ---------------------------------------------------------------------------------- the project
class Points(Dataset):  # type: ignore[type-arg]
    """Fixed points with labels; every read draws its augmentation from torch, numpy and python."""

    def __init__(self, n: int, seed: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :4].sum(dim=1) > 0).long()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.augment:
            x = x + 0.2 * torch.randn(16)  # torch: jitter
            x = x * float(np.random.uniform(0.8, 1.2))  # numpy: scale
            if random.random() < 0.5:  # python: flip the last features
                x = torch.cat([x[:8], x[8:].flip(0)])
        return x, self.y[i]


class PointsData(pl.LightningDataModule):
    def __init__(self, samples: int, batch_size: int, num_workers: int, val_loaders: int) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set = Points(self.hparams.samples, 0, augment=True)
        self.val_sets = [Points(64, 100 + i, augment=False) for i in range(self.hparams.val_loaders)]

    def train_dataloader(self) -> DataLoader[Any]:
        workers = self.hparams.num_workers
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    def val_dataloader(self) -> Any:
        loaders = [DataLoader(s, batch_size=32) for s in self.val_sets]
        return loaders[0] if len(loaders) == 1 else loaders

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_sets[0], batch_size=32)


class Classifier(pl.LightningModule):
    def __init__(self, scheduler: str = "onecycle", val_loaders: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2))
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=2)
        self.val_acc = nn.ModuleList(
            torchmetrics.classification.MulticlassAccuracy(num_classes=2) for _ in range(val_loaders)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        logits = self.net(x)
        suffix = f"_{dataloader_idx}" if dataloader_idx else ""  # "val_loss" is the first loader's
        self.val_acc[dataloader_idx](logits, y)
        self.log(f"val_loss{suffix}", nn.functional.cross_entropy(logits, y), add_dataloader_idx=False)
        self.log(f"val_acc{suffix}", self.val_acc[dataloader_idx], on_epoch=True, add_dataloader_idx=False)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        if self.hparams.scheduler == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}
        total = self.trainer.estimated_stepping_batches  # builds the train loader early, as many projects do
        onecycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": onecycle, "interval": "step"}}


class TeacherClassifier(Classifier):
    """``Classifier`` with an EMA teacher moved (with the batch) and logged in its own ``on_train_batch_end``."""

    def __init__(self, scheduler: str = "onecycle", val_loaders: int = 1) -> None:
        super().__init__(scheduler, val_loaders)
        self.register_buffer("teacher", torch.zeros(64, 16))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.teacher.mul_(0.9).add_(0.1 * self.net[0].weight.detach()).add_(1e-3 * batch[0].mean())
        self.log("teacher", self.teacher.sum())
        self.log("teacher_epoch", self.teacher.sum() + outputs["loss"].detach(), on_step=False, on_epoch=True)


# ---------------------------------------------------------------------------------- what a run records
class JsonlLogger(Logger):
    """A logger that appends every call to a JSON-lines file at once (so a killed run keeps its record)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def name(self) -> str:
        return "jsonl"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        values = {k: float(v).hex() for k, v in sorted(metrics.items())}
        _append(self.path, {"kind": "metrics", "step": step, "metrics": values})

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        # ModelCheckpoint calls this once the file is written: note which file holds which checkpoint marker
        name = Path(checkpoint_callback._last_checkpoint_saved).name
        _append(self.path, {"kind": "file", "name": name})
        if f"{name}@{checkpoint_callback._last_global_step_saved}" == self.kill_at_file:
            os._exit(KILLED_EXIT_CODE)  # preempted right after this file was written

    kill_at_file = ""


class MarkCheckpoints(Callback):
    """Numbers the checkpoints in the record, and notes in a resumed run's record which one it resumed from.

    The number travels in the checkpoint itself (this callback's state), so a record says exactly where a resume
    started: the resumed run must log and decide what the uninterrupted run did after that marker.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        self.count += 1
        _append(self.path, {"kind": "checkpoint", "n": self.count})
        return {"n": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = int(state_dict["n"])
        _append(self.path, {"kind": "resumed_from", "n": self.count})


class Killer(Callback):
    """Ends the process abruptly after ``after`` training batches (0: never), like a preempted job.

    In every run's callbacks, killed or not: the files a run writes record the callbacks after the writer by their
    place in ``trainer.callbacks``, which one callback more would shift.
    """

    def __init__(self, after: int) -> None:
        self.after = after
        self.seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen += 1
        if self.after and self.seen >= self.after:
            os._exit(KILLED_EXIT_CODE)


class IndexWriter(BasePredictionWriter):
    """Keeps the batch indices Lightning hands to prediction writers (plain Lightning: one list per batch)."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.indices: list[list[int]] = []

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any,
                           batch_indices: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        self.indices.append(list(batch_indices))


class SaveFromHook(Callback):
    """``trainer.save_checkpoint`` from a training hook, as some projects do."""

    def __init__(self, step: int, path: Path) -> None:
        self.step = step
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def digest(tensors: dict[str, Any]) -> str:
    """SHA-256 over names and raw bytes (tensors) or reprs (other values), sorted by name."""
    from lightning_repro import digest_tensors  # a plain function: the plain-Lightning runs use it too

    return digest_tensors(tensors)


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for key, item in value.items():
            _flat(f"{prefix}.{key}", item, out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flat(f"{prefix}.{i}", item, out)
    else:
        out[prefix] = value.hex() if isinstance(value, float) else value
    return out


def _score(value: Any) -> str | None:
    return None if value is None else float(value).hex()


# ---------------------------------------------------------------------------------- one run
def build(cfg: dict[str, Any]) -> tuple[pl.Trainer, Classifier, pl.LightningDataModule, list[Callback]]:
    out = Path(cfg["out"])
    callbacks: list[Callback] = []
    if cfg["repro"]:
        from lightning_repro import DeterminismCallback

        traced = {"trace": True, "on_divergence": "error"} if cfg["trace"] else {}
        callbacks.append(DeterminismCallback(seed=cfg["seed"], deterministic=cfg["deterministic"], **traced))
        determinism: dict[str, Any] = {}
    else:
        pl.seed_everything(cfg["seed"], workers=True, verbose=False)
        determinism = {"deterministic": cfg["deterministic"]}
    module = TeacherClassifier if cfg["teacher"] else Classifier
    model = module(scheduler=cfg["scheduler"], val_loaders=cfg["val_loaders"])
    sizes = (cfg["samples"], cfg["batch_size"], cfg["num_workers"], cfg["val_loaders"])
    data: pl.LightningDataModule = PointsData(*sizes)
    if cfg["stream"]:
        from streamed_points import StreamedPointsData  # beside this file

        data = StreamedPointsData(cfg["stream"], *sizes)
    callbacks.append(IndexWriter())  # acts in trainer.predict only
    record_file = out / f"record-{cfg['tag']}.jsonl"
    callbacks.append(MarkCheckpoints(record_file))
    ckpt_dir = out / "ckpt"
    if cfg["every_n_train_steps"] or cfg["monitor_every_n_epochs"]:
        by = (
            {"every_n_epochs": cfg["monitor_every_n_epochs"]}
            if cfg["monitor_every_n_epochs"]
            else {"every_n_train_steps": cfg["every_n_train_steps"]}
        )
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir,
                filename="best-{epoch}-{step}",
                monitor="val_loss",
                save_top_k=2,
                save_last=True,
                **by,
            )
        )
    if cfg["every_n_epochs"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir,
                filename="epoch-{epoch}-{step}",
                every_n_epochs=cfg["every_n_epochs"],
                save_top_k=-1,
                save_on_train_epoch_end=cfg["save_on_train_epoch_end"],
            )
        )
    if cfg["early_stopping"]:
        callbacks.append(EarlyStopping(monitor="val_loss", patience=3, check_finite=True))
    if cfg["save_from_hook_at_step"]:
        callbacks.append(SaveFromHook(cfg["save_from_hook_at_step"], out / "hook.ckpt"))
    callbacks.append(Killer(cfg["kill_after_batches"]))
    jsonl = JsonlLogger(record_file)
    jsonl.kill_at_file = cfg["kill_at_file"]
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=cfg["max_epochs"],
        max_steps=cfg["max_steps"],
        accumulate_grad_batches=cfg["accumulate"],
        val_check_interval=cfg["val_check_interval"],
        check_val_every_n_epoch=cfg["check_val_every_n_epoch"],
        num_sanity_val_steps=2,
        logger=[CSVLogger(out / "logs", name="", version=""), jsonl],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **determinism,
    )
    return trainer, model, data, callbacks


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train once as configured; write and return ``result.json`` (digests and the callbacks' decisions)."""
    cfg = {**DEFAULTS, **cfg}
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    if cfg["trace"]:  # say "restore verified" and "continuation verified" on stderr
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("lightning_repro").setLevel(logging.INFO)
    trainer, model, data, callbacks = build(cfg)
    resume = cfg["resume"]
    if resume == "last":
        resume = str(out / "ckpt" / "last.ckpt")
    trainer.fit(model, datamodule=data, ckpt_path=resume or None)
    if cfg["save_at_end"]:
        trainer.save_checkpoint(cfg["save_at_end"])
    optimizer = trainer.optimizers[0]
    # then predict with the same datamodule, as projects do after training
    writer = next(c for c in callbacks if isinstance(c, IndexWriter))
    predictions = trainer.predict(model, datamodule=data)
    if not cfg["stream"]:  # a stream's batches have no sample indices: Lightning gives the writer none
        assert writer.indices == [list(range(i, min(i + 32, 64))) for i in range(0, 64, 32)], writer.indices
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    result: dict[str, Any] = {
        "params": digest(dict(model.named_parameters())),
        "optimizer": digest(_flat("opt", optimizer.state_dict(), {})),
        "scheduler": digest(_flat("sched", scheduler.state_dict(), {})),
        "lr": float(optimizer.param_groups[0]["lr"]).hex(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "predictions": digest({str(i): p for i, p in enumerate(predictions or [])}),
        "checkpoints": {},
        "early_stopping": None,
    }
    for i, callback in enumerate(c for c in callbacks if isinstance(c, ModelCheckpoint)):
        result["checkpoints"][str(i)] = {
            "best_k_models": {Path(k).name: _score(v) for k, v in sorted(callback.best_k_models.items())},
            "best_model_path": Path(callback.best_model_path).name if callback.best_model_path else "",
            "best_model_score": _score(callback.best_model_score),
        }
    for callback in callbacks:
        if isinstance(callback, EarlyStopping):
            result["early_stopping"] = {
                "wait_count": callback.wait_count,
                "best_score": _score(callback.best_score),
                "stopped_epoch": callback.stopped_epoch,
            }
    ckpt_dir = out / "ckpt"
    result["files"] = sorted(p.name for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.exists() else []
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------- comparing runs
def record(path: str | Path) -> list[dict[str, Any]]:
    """The record of one run (``<out>/record-<tag>.jsonl``): logged values and checkpoint markers, in order."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged_after(path: str | Path, checkpoint: int) -> list[dict[str, Any]]:
    """Everything a record logged after its checkpoint marker number ``checkpoint`` (0: from the start)."""
    seen, rows = checkpoint == 0, []
    for item in record(path):
        if item["kind"] == "checkpoint" and item["n"] == checkpoint:
            seen = True
        elif seen and item["kind"] == "metrics":
            rows.append(item)
    return rows


def last_file(path: str | Path) -> tuple[int, str]:
    """The checkpoint marker number and file name of the last checkpoint file a record wrote."""
    number, name = 0, ""
    for item in record(path):
        if item["kind"] == "checkpoint":
            number = item["n"]
        elif item["kind"] == "file":
            name = item["name"]
    return number, name


COMPARED = (
    "params", "optimizer", "scheduler", "lr", "global_step", "epoch", "predictions", "checkpoints", "early_stopping",
    "files",
)


def compare(
    reference: dict[str, Any], reference_record: str | Path, resumed: dict[str, Any], killed_record: str | Path,
    resumed_record: str | Path,
) -> list[str]:
    """What differs between the uninterrupted run and a killed + resumed one (an empty list: nothing).

    Compared: the results (digests of weights, optimizer and scheduler, the learning rate, the counters, the
    checkpoint callbacks' decisions and the files they keep, EarlyStopping's state) and every value the resumed
    run logged, against what the uninterrupted run logged after the point where the checkpoint was written: the
    rows the killed run had logged before that checkpoint are the uninterrupted run's first rows (the same run up
    to there), and the resumed run must log exactly the rows that follow them.
    """
    problems = [f"{key}: {reference[key]!r} != {resumed[key]!r}" for key in COMPARED if reference[key] != resumed[key]]
    start = next((item["n"] for item in record(resumed_record) if item["kind"] == "resumed_from"), None)
    if start is None:
        return [*problems, "the resumed run's record does not say which checkpoint it resumed from"]
    before: list[dict[str, Any]] = []
    for item in record(killed_record):
        if item["kind"] == "checkpoint" and item["n"] == start:
            break
        if item["kind"] == "metrics":
            before.append(item)
    full = logged_after(reference_record, 0)
    # a run stopped early (max_steps) logs its cut epoch's values before saving: not part of the reference
    pairs = zip(before, full, strict=False)
    common = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(before), len(full)))
    expected, got = full[common:], logged_after(resumed_record, 0)
    if got != expected:
        pairs = zip(expected, got, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(expected), len(got)))
        problems.append(
            f"logged values after checkpoint {start} differ from row {first} on: expected"
            f" {expected[first] if first < len(expected) else '(nothing)'}, got"
            f" {got[first] if first < len(got) else '(nothing)'} ({len(expected)} rows expected, {len(got)} got)"
        )
    return problems


# ---------------------------------------------------------------------------------- the demo
def _run_in_process(cfg: dict[str, Any], expect_kill: bool = False) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # fixed string hashing, as DeterminismCallback advises
    proc = subprocess.run(
        [sys.executable, __file__, "--run", json.dumps(cfg)], capture_output=True, text=True, env=env, timeout=600
    )
    expected = KILLED_EXIT_CODE if expect_kill else 0
    if proc.returncode != expected:
        raise RuntimeError(f"run exited {proc.returncode}, expected {expected}:\n{proc.stderr[-3000:]}")
    return {} if expect_kill else json.loads(Path(cfg["out"], "result.json").read_text())


def demo_mode(repro: bool, root: Path) -> list[str]:
    reference = _run_in_process({"repro": repro, "out": str(root / "a")})
    killed = {"repro": repro, "out": str(root / "b"), "kill_after_batches": 23, "tag": "killed"}  # last.ckpt: step 20
    _run_in_process(killed, expect_kill=True)
    resumed = _run_in_process({"repro": repro, "out": str(root / "b"), "resume": "last", "tag": "resumed"})
    b = root / "b"
    killed_record, resumed_record = b / "record-killed.jsonl", b / "record-resumed.jsonl"
    return compare(reference, root / "a" / "record-run.jsonl", resumed, killed_record, resumed_record)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", metavar="CONFIG_JSON", help="train once with this configuration (see DEFAULTS)")
    args = parser.parse_args()
    if args.run:
        run(json.loads(args.run))
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        futures = {mode: pool.submit(demo_mode, mode == "repro", Path(tmp, mode)) for mode in ("plain", "repro")}
        results = {mode: future.result() for mode, future in futures.items()}
    for mode, title in (("plain", "plain Lightning"), ("repro", "lightning-repro")):
        problems = results[mode]
        print(f"{title}: killed after step 23, resumed from last.ckpt (step 20):")
        print("  identical to the uninterrupted run" if not problems else "  DIFFERS:")
        for problem in problems:
            print(f"  - {problem[:300]}")
    print(f"(6 training runs in {time.perf_counter() - started:.0f} s)")
    return 0 if not results["repro"] else 1


if __name__ == "__main__":
    sys.exit(main())
