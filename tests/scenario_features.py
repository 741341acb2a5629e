"""Lightning features a user combines with the callback, for ``tests/scenario.py`` runs (its ``features`` option).

``features`` is a dict (``FEATURES`` names its keys): the Tuner or its callbacks before ``fit`` (with a
``LightningDataModule``, the model's ``lr`` and the datamodule's ``batch_size`` as the tuner expects), callbacks
(``StochasticWeightAveraging``, ``EarlyStopping``, ``Timer``, ``BackboneFinetuning``, ``LearningRateMonitor``),
several train loaders in a ``CombinedLoader`` of a given mode, ``torch.compile`` of the model's net in
``configure_model``, and any other Trainer option (``fast_dev_run``,
``overfit_batches``, ``gradient_clip_val``, ``detect_anomaly``, ``max_time``...). Every run with features records
what its loggers receive and where each checkpoint was taken (``examples/ordinary_project.py``'s ``JsonlLogger``
and ``MarkCheckpoints``: ``<out>/record-<tag>.jsonl``), so a test compares every logged row after a checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback
from lightning.pytorch.utilities import CombinedLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ordinary_project

FEATURES: dict[str, Any] = {
    "tuner": "",  # "lr_find" | "scale_batch_size" (Tuner(trainer) before fit) | "lr_finder" | "batch_size_finder"
    # "swa" | "early_stopping" | "timer" | "backbone" | "lr_monitor" | "accumulation_scheduler" (accumulate 1 in
    # epoch 0, 2 from epoch 1) | "throughput" (ThroughputMonitor) | "model_summary" | "rich_model_summary" (the
    # summary's forward pass on the model's example_input_array)
    "callbacks": [],
    "loaders": "",  # "dict" | "list": two train loaders (scenario's two_loaders) in CombinedLoader(mode=...)
    "mode": "max_size_cycle",
    "lr": "",  # float.hex() of the optimizer's lr (what a tuner found, given to the run without it)
    "compile": False,  # torch.compile the model's net in configure_model (inductor on the CPU)
    "trainer": {},  # other Trainer options
    # after fit, trainer.predict on the validation loader with a BasePredictionWriter(write_interval="batch") that
    # appends each batch's indices and prediction bits to <out>/predictions-<tag>.jsonl
    "predict": False,
    "tag": "run",  # the record's name: <out>/record-<tag>.jsonl
}
LR_FIND = {"num_training": 20, "early_stop_threshold": None}
SCALE_BATCH_SIZE = {"mode": "power", "init_val": 4, "max_trials": 3, "steps_per_trial": 2}


def options(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**FEATURES, **(cfg["features"] or {})}


def model_class(base: type[pl.LightningModule]) -> type[pl.LightningModule]:
    """The scenario's model with an ``lr`` and a ``backbone`` (its first layer), optimising what is trainable."""

    class FeatureModel(base):  # type: ignore[misc, valid-type]
        def __init__(self, cfg: dict[str, Any]) -> None:
            super().__init__(cfg)
            feat = options(cfg)
            self.lr = float.fromhex(feat["lr"]) if feat["lr"] else 1e-2
            # a batch of each loader in one step, but one loader's batch at a time in "sequential" mode
            self.cfg = {**self.cfg, "two_loaders": bool(feat["loaders"]) and feat["mode"] != "sequential"}
            if {"model_summary", "rich_model_summary"} & set(feat["callbacks"]):  # the summary runs a forward pass
                self.example_input_array = torch.zeros(2, cfg["dim"])
            self.forwards = 0  # training calls self.net: these are the summary's and predict's

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.forwards += 1
            return self.net(x) + torch.rand(()) * 1e-3  # type: ignore[no-any-return]  # a process-stream draw

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            return self(batch[0]), batch[2]

        @property
        def backbone(self) -> torch.nn.Module:
            return getattr(self.net, "_orig_mod", self.net)[0]  # type: ignore[no-any-return]

        def configure_model(self) -> None:
            super().configure_model()
            if options(self.cfg)["compile"] and not hasattr(self.net, "_orig_mod"):  # once: a module fitted again
                self.net = torch.compile(self.net)

        def training_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            if isinstance(batch, dict) and "a" in batch:  # the CombinedLoader's dict (a pipeline's batch: its own)
                batch = [batch["a"], batch["b"]]
            return super().training_step(batch, batch_idx)  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            # BackboneFinetuning freezes the backbone before this and adds it as a param group when it unfreezes
            opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)
            if not self.cfg["scheduler"]:
                return opt
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.97)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return FeatureModel


class ScenarioData(pl.LightningDataModule):
    """The scenario's loaders from a datamodule whose ``batch_size`` the batch size finder changes."""

    def __init__(self, cfg: dict[str, Any], loaders: Any) -> None:
        super().__init__()
        self.cfg, self.loaders, self.batch_size = cfg, loaders, cfg["batch_size"]

    def train_dataloader(self) -> Any:
        return self.loaders({**self.cfg, "batch_size": self.batch_size})[0]

    def val_dataloader(self) -> Any:
        return self.loaders(self.cfg)[1]


def train_data(cfg: dict[str, Any], loaders: Any) -> Any:
    """The train data ``fit`` gets: a ``CombinedLoader`` of two loaders, or the scenario's own."""
    feat = options(cfg)
    if not feat["loaders"]:
        return loaders(cfg)[0]
    a, b = loaders({**cfg, "two_loaders": True})[0]
    return CombinedLoader({"a": a, "b": b} if feat["loaders"] == "dict" else [a, b], mode=feat["mode"])


def callbacks(cfg: dict[str, Any], out: Path) -> list[Callback]:
    from lightning.pytorch import callbacks as cb

    feat = options(cfg)
    made: list[Callback] = [ordinary_project.MarkCheckpoints(out / f"record-{feat['tag']}.jsonl")]
    names = feat["callbacks"]
    if "swa" in names:
        made.append(cb.StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=2, annealing_epochs=2))
    if "early_stopping" in names:
        # mode="max" on a loss that falls: every validation after the first one counts towards the patience
        made.append(cb.EarlyStopping(monitor="val_loss", mode="max", patience=4))
    if "timer" in names:
        made.append(cb.Timer(duration={"days": 1}, interval="step"))
    if "backbone" in names:
        made.append(cb.BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5))
    if "lr_monitor" in names:
        made.append(cb.LearningRateMonitor(logging_interval="step"))
    if "accumulation_scheduler" in names:
        made.append(cb.GradientAccumulationScheduler(scheduling={0: 1, 1: 2}))
    if "throughput" in names:
        made.append(cb.ThroughputMonitor(batch_size_fn=batch_size, window_size=4))
    if "model_summary" in names:
        made.append(cb.ModelSummary(max_depth=2))
    if "rich_model_summary" in names:
        made.append(cb.RichModelSummary(max_depth=2))
    if feat["predict"]:
        made.append(PredictionRecorder(out / f"predictions-{feat['tag']}.jsonl"))
    if feat["tuner"] == "lr_finder":
        made.insert(0, cb.LearningRateFinder(num_training_steps=LR_FIND["num_training"], early_stop_threshold=None))
    if feat["tuner"] == "batch_size_finder":
        made.insert(0, cb.BatchSizeFinder(**SCALE_BATCH_SIZE))
    return made


def batch_size(batch: Any) -> int:
    """ThroughputMonitor's ``batch_size_fn``: the samples of a batch (x, y, index)."""
    return len(batch[1])


class PredictionRecorder(BasePredictionWriter):
    """Appends every predicted batch's ``batch_indices``, sample indices and prediction bits to a JSON-lines file."""

    def __init__(self, path: Path) -> None:
        super().__init__(write_interval="batch")
        self.path = path

    def write_on_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, prediction: Any, batch_indices: Any, batch: Any,
        batch_idx: int, dataloader_idx: int,
    ) -> None:
        values, indices = prediction
        row = {
            "batch_idx": batch_idx,
            "batch_indices": list(batch_indices) if batch_indices is not None else None,
            "indices": indices.tolist(),
            "values": [v.hex() for v in values.double().flatten().tolist()],
        }
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def predict(trainer: pl.Trainer, model: Any, cfg: dict[str, Any], loaders: Any) -> None:
    """``trainer.predict`` after ``fit`` on the validation loader (``predict`` option), its rows written as it goes."""
    if options(cfg)["predict"]:
        trainer.predict(model, loaders(cfg)[1], return_predictions=False)


def logger(cfg: dict[str, Any], out: Path) -> Any:
    return ordinary_project.JsonlLogger(out / f"record-{options(cfg)['tag']}.jsonl")


def tune(trainer: pl.Trainer, model: Any, datamodule: ScenarioData, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the Tuner before ``fit`` (``tuner`` "lr_find" or "scale_batch_size"); what it found."""
    from lightning.pytorch.tuner import Tuner

    tuner = options(cfg)["tuner"]
    if tuner == "lr_find":
        Tuner(trainer).lr_find(model, datamodule=datamodule, **LR_FIND)
    elif tuner == "scale_batch_size":
        Tuner(trainer).scale_batch_size(model, datamodule=datamodule, **SCALE_BATCH_SIZE)
    return found(model, datamodule)


def found(model: Any, datamodule: ScenarioData | None) -> dict[str, Any]:
    return {"lr": float(model.lr).hex(), "batch_size": datamodule.batch_size if datamodule is not None else None}


def result(trainer: pl.Trainer, out: Path) -> dict[str, Any]:
    """What the callbacks decided (their states, by the runner's flat values), and what lies in ``out``."""
    from runner import flat_values

    states = {}
    for callback in trainer.callbacks:
        if type(callback).__module__.startswith("lightning.pytorch.callbacks") and callback.state_dict():
            states[callback.state_key] = flat_values(callback.state_dict(), out)
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    forwards = getattr(trainer.lightning_module, "forwards", 0)
    return {"callback_states": states, "files_in_out": files, "forwards": forwards}
