"""A configurable training run, used by the tests in fresh processes.

Usage: ``python tests/scenario.py CONFIG_JSON``. The config names every option (see
``DEFAULTS``); the run writes ``<out>/result.json`` (digests of every parameter and optimizer
tensor, epoch metrics) and appends one line per training step to ``<out>/steps.jsonl``.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    SubsetRandomSampler,
    WeightedRandomSampler,
    get_worker_info,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mpwarm
import scenario_features
import streaming_pipelines

DEFAULTS: dict[str, Any] = {
    "out": "",
    "repro": True,  # DeterminismCallback on, else plain Lightning with seed_everything(workers=True)
    "seed": 1234,
    "n": 96,
    "dim": 8,
    "batch_size": 8,
    "num_workers": 0,
    "persistent_workers": False,
    "shuffle": True,
    "sampler": "default",  # "weighted": WeightedRandomSampler(replacement=True), seeded through its `generator`
    # "subset": SubsetRandomSampler over the even indices (no generator); "subset_generator": the same with the
    # user's own torch.Generator (seeded 7); "bucket": a user's batch sampler (BucketBatchSampler: the indices by
    # torch.randperm, the batches' order by random.shuffle, from the process streams); "bucket_generator": the same
    # drawing from its own torch.Generator, reseeded in set_epoch (as DistributedSampler does)
    "val": "epoch",  # "off" | "epoch" | int (every N batches) | float (fraction of the epoch)
    "val_workers": 0,
    "max_epochs": 2,
    "max_steps": -1,
    "accumulate": 1,
    "two_loaders": False,
    "metrics": True,
    "scheduler": True,  # StepLR per step; "onecycle": OneCycleLR sized by estimated_stepping_batches (built early)
    "dropout": 0.3,
    "ckpt_every_n_steps": 0,  # ModelCheckpoint(every_n_train_steps=...); a list: one ModelCheckpoint per value
    "save_last": False,  # the step ModelCheckpoint(s) also write last.ckpt (last-every<N>.ckpt when there are several)
    "batchnorm": False,  # a BatchNorm1d after the first layer (its running stats move with every batch)
    "ema": False,  # EMAWeightAveraging(decay=0.9): checkpoints hold current_model_state and averaging_state
    # the module's own on_train_batch_end moves an EMA teacher buffer (BYOL, DINO) and logs it (a step value and an
    # epoch mean): a checkpoint written in that hook (ModelCheckpoint by step) is written before it runs
    "teacher": False,
    # with "teacher": its on_train_batch_end (run again on resume when the file is written in that hook) appends what
    # it reads in trainer.callback_metrics and logged_metrics to <out>/metrics-rank<R>.jsonl
    "read_metrics": False,
    "log_every_n_steps": None,  # Trainer(log_every_n_steps=...) when given (Lightning's default: 50)
    # ModelPruning at each epoch's end: True or "random": "random_unstructured" (amount 0.3), masks drawn from the
    # process streams; "l1": "l1_unstructured" over the whole model (amount 0.3) with the lottery-ticket reset
    "pruning": False,
    "ckpt_every_n_epochs": 0,  # ModelCheckpoint(every_n_epochs=...)
    # ModelCheckpoint(monitor="val_loss", every_n_train_steps=N): before the first validation a due step has no
    # val_loss yet, so the callback defers its save to the next validation end (`_defer_save_until_validation`)
    "ckpt_monitor_every_n_steps": 0,
    "kill_after_batches": 0,  # SIGKILL itself after this many train batches (0: never; runner.KILLED)
    "save_at_end": "",  # trainer.save_checkpoint(path) after fit
    "resume": "",  # ckpt_path for fit
    "sample_keyed": True,
    "deterministic": True,
    "pin_memory": False,
    "user_worker_init": False,
    "reload_every_epoch": False,  # loaders come from the module's train_dataloader(), re-created each epoch
    "accelerator": "cpu",
    "strategy": "auto",  # "ddp_repro" for the DDP tests
    "ddp_kwargs": None,  # keyword arguments of the DDP strategy ("ddp_repro" or "ddp"): {"broadcast_buffers": False}
    "devices": 1,
    "num_nodes": 1,
    "on_topology_change": "error",
    "on_env_drift": "warn",  # DeterminismCallback(on_env_drift=...)
    # the job's processes start without PYTHONHASHSEED (runner.run_ddp; else the runner's "0"), as a user's `python
    # train.py` does: ReproDDPStrategy then exports the seed to the ranks Lightning's launcher starts (rank 1)
    "unset_hash_seed": False,
    # this global rank's module adds 1e-3 to the optimizer's first moment of the first parameter in the checkpoint it
    # loads (on_load_checkpoint, before Lightning loads it; DDP would overwrite changed weights with rank 0's): that
    # rank resumes from another optimizer state than the file's
    "perturb_on_load_rank": None,
    "node_env": None,  # launcher "nodes": {"1": {"MKL_NUM_THREADS": "1"}}, variables of one node's process (runner)
    "limit_train_batches": 1.0,
    "dataset": "noisy",  # "noisy" | "sparse_numpy" (numpy on every 7th index only) | "late_python" (index >= 50)
    # the train data from a streaming library (tests/streaming_pipelines.py): {"lib": ..., "data": DIR}, built in
    # the module's train_dataloader (the rank is known there); the module calls set_epoch at every epoch start
    "pipeline": None,
    "mp_context": None,  # DataLoader multiprocessing_context for workers ("forkserver" under DDP)
    "warm_forkserver": True,  # that fork server forked from the run at its start (tests/mpwarm.py), not spawned
    # export RANK and WORLD_SIZE as torchrun does: webdataset's split_by_node reads them in a worker that a fork server
    # started (torch.distributed is not initialized there; Lightning's launcher and the "nodes" jobs set neither)
    "rank_env": False,
    "report_process_group_at_exit": False,  # write <out>/process-group-at-exit-rank<R>.txt from the last atexit handler
    "trace": False,  # DeterminismCallback(trace=True, on_divergence="error"): per-rank traces beside the checkpoints
    "on_divergence": "error",  # with trace: "warn" goes on after a divergence (the resumed run's lines say it)
    "on_exception_ckpt": False,  # OnExceptionCheckpoint(<out>/ckpt): the file a preempted run leaves
    # every rank (every process) sends itself this signal: {"signal": "SIGTERM", "where": "train" | "validation",
    # "batch": k}, at the end of its k-th training batch, or of the k-th batch of its first validation during training
    "signal_self": None,
    # at the end of this training batch, write <out>/reached-rank<R>, then sleep 0.1 s before every later batch:
    # the window in which a test signals the job from outside, as a scheduler does
    "reached_marker_at": 0,
    "csv_logger": False,  # CSVLogger(<out>/logs) instead of logger=False (its log_dir is <out>/logs)
    "draw_at_batch_start": False,  # a callback draws from python, numpy and torch in every on_train_batch_start
    # each rank logs its own "val_rank" (RANK_METRIC, without sync_dist) at each validation's end, and
    # EarlyStopping(monitor="val_rank", mode="min", patience=1) watches it: each rank's own best score and count
    "rank_early_stopping": False,
    # inside the k-th training batch of the run (from 0), {"where": "on_train_batch_start" (a callback's, after the
    # draw_at_batch_start callback's) | "training_step" (after its draws and its self.log) | "fetch" (in the dataset's
    # __getitem__ after its draws, num_workers=0), "batch": k}, with "exc": "KeyboardInterrupt" | "RuntimeError" raised
    # (on global rank "rank" only, when given)
    "raise_in_batch": None,
    # ... or trainer.save_checkpoint(<out>/ckpt/in-batch.ckpt) there ("training_step", "on_train_batch_start"), going on
    "save_in_batch": None,
    # sharded training: {"dp": 2, "tp": 1} and optionally "layout" ("distributed": a checkpoint directory, the
    # default; "file": one file), "mp_policy" (FSDP2's MixedPrecisionPolicy in bf16), "empty_init" (the model built
    # on the meta device by trainer.init_module), "plain" (Lightning's ModelParallelStrategy, not ours). The model
    # gets fully_shard on each Linear and on the whole net, after ColwiseParallel/RowwiseParallel when tp > 1.
    "sharded": None,
    "precision": "32-true",
    # the train data as a sharded IterableDataset (ShardedStream) instead of a map-style dataset: {"state": its own
    # state_dict()/load_state_dict(), "sized": a __len__, "unequal": worker 1's shard is short, "set_epoch": the
    # module calls dataset.set_epoch(epoch) in on_train_epoch_start and the dataset shuffles by it ("never": it
    # shuffles by its epoch, which nothing sets)}
    "stream": None,
    "stateful_loader": False,  # torchdata's StatefulDataLoader instead of torch's DataLoader (train loader)
    # Lightning features combined with the callback (tests/scenario_features.py: FEATURES): the Tuner, callbacks,
    # a CombinedLoader, other Trainer options; the run then records every logged row (<out>/record-<tag>.jsonl)
    "features": None,
    # a SLURM job with Lightning's auto-requeue: {"batch": k or None, "validation": False}. SLURM's variables are set
    # (task 0 of one, job 4242, unless the launcher set them), a fake `scontrol` on PATH appends its arguments to
    # <out>/scontrol.log, and after the backward of the run's k-th training batch (with "validation": at the end of
    # its k-th validation batch) the whole job (this process and its workers) gets SIGUSR1, as slurmstepd signals
    # every process of the job step before its time limit (`sbatch --signal=USR1@90`)
    "slurm": None,
}


class NoisyDataset(Dataset):  # type: ignore[type-arg]
    """Each sample draws from torch, numpy and python ``random``: augmentation."""

    def __init__(self, n: int, dim: int, offset: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g) + offset
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        noise = 0.1 * torch.randn(self.x.shape[1]) + float(np.random.rand()) * 0.01 + random.random() * 0.01
        if RAISE_IN_GETITEM:  # raise_in_batch "fetch": in the middle of the batch's augmentation
            raise RAISE_IN_GETITEM.pop()("raised in __getitem__")
        return self.x[i] + noise, self.y[i], i


RAISE_IN_GETITEM: list[type[BaseException]] = []  # set by InBatch before the fetch it raises in
EXCEPTIONS: dict[str, type[BaseException]] = {"KeyboardInterrupt": KeyboardInterrupt, "RuntimeError": RuntimeError}


class SparseNumpyDataset(NoisyDataset):
    """Draws from torch on every sample, from numpy only when ``i % 7 == 0``: samples use different streams."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        noise = 0.1 * torch.randn(self.x.shape[1])
        if i % 7 == 0:
            noise = noise + float(np.random.rand()) * 0.01
        return self.x[i] + noise, self.y[i], i


class LatePythonDataset(NoisyDataset):
    """Draws from torch on every sample, from python ``random`` only when ``i >= 50``."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        noise = 0.1 * torch.randn(self.x.shape[1])
        if i >= 50:
            noise = noise + random.random() * 0.01
        return self.x[i] + noise, self.y[i], i


class ShardedStream(IterableDataset):  # type: ignore[type-arg]
    """A stream of ``n`` items, sharded by rank (torch.distributed) and then by dataloader worker, augmented from
    torch, numpy and python ``random`` per item; without ``state``, its ``__iter__`` draws a rotation of the shard
    from torch's global RNG first (a draw of the generator's body before its first item)."""

    def __init__(self, n: int, dim: int, options: dict[str, Any]) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.options = options
        self.epoch = 0
        self._start = 0  # the position load_state_dict gave (this worker's copy)
        self.pos = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _shard(self) -> list[int]:
        ids = list(range(len(self.x)))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            ids = ids[rank::world]
        if self.options.get("set_epoch"):
            random.Random(self.epoch).shuffle(ids)
        info = get_worker_info()
        if info is None:
            return ids
        if self.options.get("worker_seed"):  # the shard's order from the worker's seed (torch's base seed + id)
            random.Random(info.seed).shuffle(ids)
        if self.options.get("unequal") and info.num_workers == 2:
            cut = (len(ids) * 7) // 10
            return ids[:cut] if info.id == 0 else ids[cut:]
        return ids[info.id :: info.num_workers]

    def __iter__(self) -> Any:
        ids = self._shard()
        start, self._start = self._start, 0
        if not self.options.get("state"):
            shift = int(torch.randint(0, len(ids), ()).item()) if ids else 0
            ids = ids[shift:] + ids[:shift]
        for j in range(start, len(ids)):
            self.pos = j + 1  # before the yield: the state after this item
            i = ids[j]
            noise = 0.1 * torch.randn(self.x.shape[1]) + float(np.random.rand()) * 0.01 + random.random() * 0.01
            yield self.x[i] + noise, self.y[i], i

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._start = self.pos = int(state["pos"])


class _Sized(ShardedStream):
    def __len__(self) -> int:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return len(range(0, len(self.x), world))


class _NoState(ShardedStream):
    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


class _SizedNoState(_Sized):
    state_dict = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]


def stream_dataset(cfg: dict[str, Any]) -> ShardedStream:
    options = cfg["stream"]
    kinds = {(True, True): _Sized, (True, False): ShardedStream, (False, True): _SizedNoState, (False, False): _NoState}
    return kinds[bool(options.get("state")), bool(options.get("sized"))](cfg["n"], cfg["dim"], options)


class SetEpoch(Callback):
    """``dataset.set_epoch(epoch)`` at every epoch start, as users do (a mid-epoch resume does not run it)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.dataset.set_epoch(trainer.current_epoch)


DATASETS = {"noisy": NoisyDataset, "sparse_numpy": SparseNumpyDataset, "late_python": LatePythonDataset}


def user_worker_init(worker_id: int) -> None:
    marker = os.environ.get("REPRO_TEST_MARKER_DIR")
    if marker:
        Path(marker, f"worker-{os.getpid()}-{worker_id}").write_text("called")


class Model(pl.LightningModule):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        norm: list[nn.Module] = [nn.BatchNorm1d(16)] if cfg["batchnorm"] else []
        self.net = nn.Sequential(
            nn.Linear(cfg["dim"], 16), *norm, nn.ReLU(), nn.Dropout(cfg["dropout"]), nn.Linear(16, 1)
        )
        if cfg["metrics"]:
            import torchmetrics

            self.train_mse = torchmetrics.MeanSquaredError()
            self.train_mean = torchmetrics.MeanMetric()
        self.steps_file = Path(cfg["out"], "steps.jsonl")
        meta = any(p.is_meta for p in self.parameters())  # trainer.init_module(empty_init=True): no values yet
        self.init_digest = "" if meta else digest(dict(self.named_parameters()))  # before DDP syncs anything
        self.init_full = ""  # sharded: the full parameters once they are materialised (gathered in on_fit_start)

    def configure_model(self) -> None:
        sharded = self.cfg["sharded"]
        if not sharded:
            return
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if isinstance(self.net, FSDPModule):
            return  # configure_model runs once per fit; this module may be fitted again
        mesh = self.device_mesh
        if sharded.get("tp", 1) > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            last = str(len(self.net) - 1)
            parallelize_module(self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), last: RowwiseParallel()})
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        options: dict[str, Any] = {"mesh": mesh["data_parallel"]}
        if sharded.get("mp_policy"):
            options["mp_policy"] = policy
        for module in self.net:
            if isinstance(module, nn.Linear):
                fully_shard(module, **options)
        fully_shard(self.net, **options)

    def on_fit_start(self) -> None:
        if self.trainer.world_size > 1:
            self.steps_file = Path(self.cfg["out"], f"steps-rank{self.global_rank}.jsonl")
        if self.cfg["sharded"] and not self.cfg["resume"]:  # a collective: every rank gathers the full tensors
            from torch.distributed.tensor import DTensor

            full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in self.named_parameters()}
            self.init_full = digest(full)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        x, y, idx = streaming_pipelines.as_tuple(batch)
        pred = self.net(x).float()  # bf16 under FSDP2's MixedPrecisionPolicy
        return nn.functional.mse_loss(pred, y), pred, idx.tolist()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.cfg["two_loaders"]:
            loss_a, pred, idx_a = self._loss(batch[0])
            loss_b, _, idx_b = self._loss(batch[1]) if batch[1] is not None else (0.0, None, None)  # run out: max_size
            loss = loss_a + 0.5 * loss_b
            indices: list[Any] = [idx_a, idx_b]
            y = streaming_pipelines.as_tuple(batch[0])[1]
        else:
            loss, pred, indices = self._loss(batch)
            y = streaming_pipelines.as_tuple(batch)[1]
        extra = torch.rand(()) * 1e-3  # a process-stream draw inside training_step
        loss = loss + extra
        mask = nn.functional.dropout(torch.ones(32), 0.5, training=True) == 0  # drawn like the model's dropout
        self.log("train_loss", loss, on_step=True, on_epoch=True, batch_size=len(y))
        if self.cfg["save_in_batch"] or self.cfg["raise_in_batch"]:  # `doctor` replays the step without a Trainer
            in_batch(self.cfg, "training_step", self.trainer)
        if self.cfg["metrics"]:
            self.train_mse.update(pred.detach(), y)
            self.train_mean.update(loss.detach())
            self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        record = {
            "epoch": self.current_epoch,
            "batch_idx": batch_idx,
            "global_step": self.global_step,
            "indices": indices,
            "loss": loss.detach().double().item().hex(),
            "dropout": hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:16],
        }
        with self.steps_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return loss

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.cfg["perturb_on_load_rank"] == self.global_rank:
            checkpoint["optimizer_states"][0]["state"][0]["exp_avg"] += 1e-3

    def on_train_epoch_end(self) -> None:
        if self.cfg["metrics"]:
            self.log("train_mean_epoch", self.train_mean.compute())
            self.train_mean.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, _, indices = self._loss(batch)
        # sync_dist: a collective in every validation step under DDP (every rank must validate alike)
        self.log("val_loss", loss + torch.rand(()) * 1e-3, batch_size=len(indices), sync_dist=True)

    def on_train_epoch_start(self) -> None:
        if self.cfg["pipeline"]:
            streaming_pipelines.set_epoch(self.current_epoch)  # as HF's docs show

    def train_dataloader(self) -> Any:
        if self.cfg["pipeline"]:
            return streaming_pipelines.train_loader(self.cfg, self.global_rank, self.trainer.world_size)
        return loaders(self.cfg)[0]

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        if not self.cfg["scheduler"]:
            return opt
        sched: Any = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.97)
        if self.cfg["scheduler"] == "onecycle":  # sized by estimated_stepping_batches: the train loader built early
            total = self.trainer.estimated_stepping_batches  # a stream without length: max_steps (-1), so 1000
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=int(total) if total > 0 else 1000)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TeacherModel(Model):
    """``Model`` with an EMA teacher moved and logged in its own ``on_train_batch_end`` (``DEFAULTS["teacher"]``)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        self.register_buffer("teacher", torch.zeros(16, cfg["dim"]))

    def configure_model(self) -> None:
        super().configure_model()
        from torch.distributed.tensor import DTensor

        weight = self.net[0].weight
        if isinstance(weight, DTensor) and not isinstance(self.teacher, DTensor):  # sharded as the student is (DINO)
            self.teacher = torch.zeros_like(weight.detach())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        from torch.distributed.tensor import DTensor

        x = streaming_pipelines.as_tuple(batch[0] if self.cfg["two_loaders"] else batch)[0]
        if isinstance(self.teacher, DTensor):  # each rank moves its shard; the logged sum gathers the shards
            self.teacher.mul_(0.9).add_(0.1 * self.net[0].weight.detach()).add_(1e-3 * float(x.float().mean()))
            total = self.teacher.full_tensor().sum()
        else:
            self.teacher.mul_(0.9).add_(0.1 * self.net[0].weight.detach()).add_(1e-3 * x.float().mean())  # and batch
            total = self.teacher.sum()
        self.log("teacher", total, sync_dist=True)
        value = total + outputs["loss"].detach()  # each rank's batch
        self.log("teacher_epoch", value, on_step=False, on_epoch=True, sync_dist=True)
        if self.cfg["read_metrics"]:
            trainer = self.trainer
            read = {"global_step": self.global_step}
            for name, values in (("callback", trainer.callback_metrics), ("logged", trainer.logged_metrics)):
                read[name] = {key: float(value).hex() for key, value in sorted(values.items())}
            with Path(self.cfg["out"], f"metrics-rank{self.global_rank}.jsonl").open("a") as f:
                f.write(json.dumps(read) + "\n")


class Killer(Callback):
    def __init__(self, after: int) -> None:
        self.after = after
        self.seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen += 1
        if self.after and self.seen >= self.after:  # a scheduler's SIGKILL: no hook, no `finally`, no write survives
            os.kill(os.getpid(), signal.SIGKILL)


def _as_slurm_job(out: Path) -> None:
    """This process is a task of SLURM job 4242 (``DEFAULTS["slurm"]``; task 0 of one unless the job's launcher
    set the task's variables: ``runner.run_ddp(launcher="slurm")``), with an ``scontrol`` that logs."""
    job = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0"}
    for name, value in {**job, "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}.items():
        os.environ.setdefault(name, value)
    bin_dir = out / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{out / "scontrol.log"}"\n')
    scontrol.chmod(0o755)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


class RequeueSignal(Callback):
    """SIGUSR1 to this process's group (its workers too) after the backward of training batch ``batch`` (from 0; a
    list: each rank's), or (``validation``) at the end of the ``batch``-th validation batch of the run (from 0)."""

    def __init__(self, batch: int | list[int] | None, validation: bool = False) -> None:
        self.batch, self.validation, self.val_seen = batch, validation, 0

    def _send(self) -> None:
        self.batch = None
        os.killpg(0, signal.SIGUSR1)
        time.sleep(0.3)  # the workers' handlers run meanwhile (Lightning's, inherited by a forked worker, wrote)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batch = self.batch[trainer.global_rank] if isinstance(self.batch, list) else self.batch
        if not self.validation and trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1 == batch:
            self._send()

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.validation and not trainer.sanity_checking:
            if self.val_seen == self.batch:
                self._send()
            self.val_seen += 1


class SignalSelf(Callback):
    """Sends this process ``cfg["signal"]`` at a given training or validation batch (``DEFAULTS["signal_self"]``)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.signum = signal.Signals[cfg["signal"]]
        self.where, self.batch = cfg["where"], cfg["batch"]
        self.train_seen = self.val_seen = 0
        if self.signum == signal.SIGINT and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # a job started in the background (`cmd &` in a script, as CI may) inherits SIGINT ignored, and Python
            # then leaves it ignored: give this run the KeyboardInterrupt of an interactive one
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.train_seen += 1
        if self.where == "train" and self.train_seen == self.batch:
            os.kill(os.getpid(), self.signum)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.sanity_checking or self.where != "validation":
            return
        self.val_seen += 1
        if self.val_seen == self.batch:
            os.kill(os.getpid(), self.signum)


def in_batch(cfg: dict[str, Any], where: str, trainer: pl.Trainer) -> None:
    """``save_in_batch`` and ``raise_in_batch`` (see ``DEFAULTS``) at ``where`` of the current training batch."""
    batch = trainer.fit_loop.epoch_loop.batch_progress.total.ready - 1  # counted read before the batch's hooks
    save, stop = cfg["save_in_batch"], cfg["raise_in_batch"]
    if save and (save["where"], save["batch"]) == (where, batch):
        trainer.save_checkpoint(Path(cfg["out"], "ckpt", "in-batch.ckpt"))
    mine = stop and stop.get("rank", trainer.global_rank) == trainer.global_rank
    if mine and (stop["where"], stop["batch"]) == (where, batch):
        raise EXCEPTIONS[stop["exc"]](f"raised in {where} of batch {batch}")


class DrawAtBatchStart(Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        torch.rand(2), np.random.rand(), random.random()


RANK_METRIC = {0: [12.0, 10.0, 9.0, 8.0, 7.0, 6.0], 1: [4.0, 5.0, 3.0, 2.0, 1.0, 0.0]}  # rank -> value per epoch


class RankMetric(Callback):
    """``rank_early_stopping``: this rank's ``val_rank`` of the epoch (rank 1's worsens at epoch 1: the stop)."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            pl_module.log("val_rank", RANK_METRIC[trainer.global_rank][trainer.current_epoch], sync_dist=False)


class InBatch(Callback):
    """``save_in_batch`` and ``raise_in_batch`` in ``on_train_batch_start``; arms the raise in ``__getitem__``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        in_batch(self.cfg, "on_train_batch_start", trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        stop, done = self.cfg["raise_in_batch"], trainer.fit_loop.epoch_loop.batch_progress.total.ready
        if stop and stop["where"] == "fetch" and stop["batch"] == done:  # the next batch's fetch raises
            RAISE_IN_GETITEM.append(EXCEPTIONS[stop["exc"]])


class ReachedMarker(Callback):
    """Writes ``<out>/reached-rank<R>`` at the end of training batch ``at``, then slows every later batch down."""

    def __init__(self, out: Path, at: int) -> None:
        self.out, self.at, self.seen = out, at, 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.seen >= self.at:
            time.sleep(0.1)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen += 1
        if self.seen == self.at:
            (self.out / f"reached-rank{trainer.global_rank}").write_text(str(os.getpid()))


class EpochMetrics(Callback):
    """Appends the epoch-level logged values of each finished epoch to ``epochs.jsonl``."""

    def __init__(self, out: Path) -> None:
        self.file = out / "epochs.jsonl"

    def _dump(self, trainer: pl.Trainer, epoch: int) -> None:
        values = {
            k: float(v).hex() for k, v in sorted(trainer.callback_metrics.items()) if k.endswith(("_epoch", "mse"))
        }
        with self.file.open("a") as f:
            f.write(json.dumps({"epoch": epoch, "values": values}) + "\n")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > 0 and any(k.endswith("_epoch") for k in trainer.callback_metrics):
            self._dump(trainer, trainer.current_epoch - 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dump(trainer, trainer.current_epoch - 1)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    from lightning_repro import digest_tensors

    return digest_tensors(tensors)


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"{pid}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def _cuda_streams_in(path: str) -> int:
    """How many CUDA RNG states our entry in the checkpoint at ``path`` holds (-1: no checkpoint)."""
    if not path:
        return -1
    entry = torch.load(path, weights_only=True)["callbacks"].get("DeterminismCallback", {})
    return len(entry.get("streams", {}).get("cuda", []))


class BucketBatchSampler:
    """A user's batch sampler, as length bucketing is written: not a ``BatchSampler``, its own ``__iter__``.

    The indices in a random order, cut into batches of ``batch_size`` (the last one shorter), the batches shuffled.
    ``own=False``: ``torch.randperm`` and ``random.shuffle`` on the process streams; ``own=True``: a
    ``torch.Generator`` of its own, reseeded with ``7 + epoch`` in ``set_epoch``.
    """

    def __init__(self, n: int, batch_size: int, *, own: bool) -> None:
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(7) if own else None
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.generator is not None:
            self.generator.manual_seed(7 + epoch)

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        batches = [order[i : i + self.batch_size] for i in range(0, self.n, self.batch_size)]
        if self.generator is None:
            random.shuffle(batches)
        else:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=self.generator).tolist()]
        yield from batches


def loaders(cfg: dict[str, Any]) -> tuple[Any, Any]:
    kw: dict[str, Any] = {
        "batch_size": cfg["batch_size"],
        "num_workers": cfg["num_workers"],
        "persistent_workers": cfg["persistent_workers"] and cfg["num_workers"] > 0,
        "pin_memory": cfg["pin_memory"],
    }
    if cfg["mp_context"] and cfg["num_workers"] > 0:
        kw["multiprocessing_context"] = cfg["mp_context"]
    if cfg["user_worker_init"]:
        kw["worker_init_fn"] = user_worker_init
    loader_cls: Any = DataLoader
    if cfg["stateful_loader"]:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader_cls = StatefulDataLoader
    if cfg["stream"] is not None:
        return loader_cls(STREAM[0], **kw), _val_loader(cfg)
    if cfg["sampler"] in ("bucket", "bucket_generator"):
        sampler = BucketBatchSampler(cfg["n"], kw.pop("batch_size"), own=cfg["sampler"] == "bucket_generator")
        kw["batch_sampler"] = sampler
    elif cfg["sampler"] == "weighted":
        kw["sampler"] = WeightedRandomSampler(torch.linspace(1.0, 2.0, cfg["n"]), cfg["n"], replacement=True)
    elif cfg["sampler"] in ("subset", "subset_generator"):
        generator = torch.Generator().manual_seed(7) if cfg["sampler"] == "subset_generator" else None
        kw["sampler"] = SubsetRandomSampler(range(0, cfg["n"], 2), generator=generator)
    else:
        kw["shuffle"] = cfg["shuffle"]
    train: Any = loader_cls(DATASETS[cfg["dataset"]](cfg["n"], cfg["dim"]), **kw)
    if cfg["two_loaders"]:
        kw2 = dict(kw, batch_size=max(1, cfg["batch_size"] // 2), shuffle=True)
        kw2.pop("sampler", None)
        train = [train, loader_cls(NoisyDataset(cfg["n"] // 3, cfg["dim"], 1.0), **kw2)]  # 8 batches of 4
    return train, _val_loader(cfg)


def _val_loader(cfg: dict[str, Any]) -> DataLoader[Any]:
    return DataLoader(
        NoisyDataset(32, cfg["dim"], 2.0),
        batch_size=8,
        num_workers=cfg["val_workers"],
        persistent_workers=False,
    )


STREAM: list[Any] = []  # the run's ShardedStream (the user's dataset object, for SetEpoch)


def _report_process_group(out: Path, devices: int) -> None:
    """Registered before the trainer exists, so it runs after every atexit handler registered during the run."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    # torchrun sets RANK; Lightning's launcher and the "nodes" jobs set NODE_RANK and LOCAL_RANK
    node, local = int(os.environ.get("NODE_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    rank = os.environ.get("RANK") or node * devices + local
    (out / f"process-group-at-exit-rank{rank}.txt").write_text("initialized" if initialized else "destroyed")


# What a dataloader worker started by a fork server needs, imported once in the server. Python 3.11's forkserver
# does not preload `__main__` (its default preload): `ensure_running` passes the main path under a key the server
# never reads, so every worker ran this script (torch, Lightning, lightning-repro: ~5 s of imports) before its
# first batch.
FORKSERVER_PRELOAD = ["numpy", "torch", "lightning.pytorch", "lightning_repro", "lightning_repro.data.takeover"]


WORKER_SERVER: list[str] = []  # "forked" or "spawned": how the workers' fork server starts (in result.json)


def _preload_fork_server(cfg: dict[str, Any]) -> None:
    if cfg["mp_context"] == "forkserver" and max(cfg["num_workers"], cfg["val_workers"]) > 0:
        import multiprocessing

        lib = str(cfg["pipeline"]["lib"]) if cfg["pipeline"] else ""
        library = {"hf": ["datasets"], "hf_parquet": ["datasets"], "hf_sdl": ["datasets", "torchdata"]}.get(
            lib, {"litdata": ["litdata"]}.get(lib, [])
        )
        if lib.startswith("wds"):
            library = ["webdataset"]
        # a module that does not import is left out by the server (it ignores ImportError)
        preload = [*FORKSERVER_PRELOAD, *library, "streaming_pipelines"]
        multiprocessing.set_forkserver_preload(preload)
        # forked from this run now, not a fresh interpreter (tests/mpwarm.py); else multiprocessing spawns it
        WORKER_SERVER.append("forked" if cfg["warm_forkserver"] and mpwarm.start(preload) else "spawned")
        (Path(cfg["out"]) / f"worker-server-{os.getpid()}.txt").write_text(WORKER_SERVER[-1])  # a killed run's too


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = {**DEFAULTS, **cfg}
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    if cfg["rank_env"]:
        node, local = int(os.environ.get("NODE_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
        os.environ["RANK"] = str(node * int(cfg["devices"]) + local)
        os.environ["WORLD_SIZE"] = str(int(cfg["devices"]) * int(cfg["num_nodes"]))
    if cfg["slurm"] is not None:
        _as_slurm_job(out)
    _preload_fork_server(cfg)  # after the environment is set: a forked server's workers have the run's at this point
    if cfg["report_process_group_at_exit"]:
        atexit.register(_report_process_group, out, int(cfg["devices"]))
    if cfg["trace"]:
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("lightning_repro").setLevel(logging.INFO)  # "continuation verified" to stderr
    callbacks: list[Callback] = []
    if cfg["repro"]:
        from lightning_repro import DeterminismCallback

        callbacks.append(
            DeterminismCallback(
                seed=cfg["seed"],
                sample_keyed=cfg["sample_keyed"],
                deterministic=cfg["deterministic"],
                on_topology_change=cfg["on_topology_change"],
                on_env_drift=cfg["on_env_drift"],
                **({"trace": True, "on_divergence": cfg["on_divergence"]} if cfg["trace"] else {}),
            )
        )
    else:
        pl.seed_everything(cfg["seed"], workers=True, verbose=False)
    empty_init = bool(cfg["sharded"] and cfg["sharded"].get("empty_init"))
    features = cfg["features"] is not None
    model_cls = scenario_features.model_class(Model) if features else TeacherModel if cfg["teacher"] else Model
    model = None if empty_init else model_cls(cfg)  # else built on the meta device, once the Trainer exists
    callbacks.append(EpochMetrics(out))
    if features:
        callbacks += scenario_features.callbacks(cfg, out)
    if cfg["stream"] is not None:
        STREAM[:] = [stream_dataset(cfg)]
        if cfg["stream"].get("set_epoch") not in (None, False, "never"):
            callbacks.append(SetEpoch(STREAM[0]))
    if cfg["pruning"]:
        from lightning.pytorch.callbacks import ModelPruning

        pruning_fn = "l1_unstructured" if cfg["pruning"] == "l1" else "random_unstructured"
        callbacks.append(ModelPruning(pruning_fn, amount=0.3, verbose=0))
    if cfg["ema"]:
        from lightning.pytorch.callbacks import EMAWeightAveraging

        callbacks.append(EMAWeightAveraging(decay=0.9))
    every_n_steps = cfg["ckpt_every_n_steps"]
    for every in every_n_steps if isinstance(every_n_steps, list) else [every_n_steps] if every_n_steps else []:
        several = isinstance(every_n_steps, list) and len(every_n_steps) > 1
        step_checkpoint = ModelCheckpoint(
            dirpath=out / "ckpt",
            filename=f"every{every}-{{epoch}}-{{step}}" if several else None,
            every_n_train_steps=every,
            save_top_k=-1,
            save_last=cfg["save_last"],
        )
        if several:
            step_checkpoint.CHECKPOINT_NAME_LAST = f"last-every{every}"
        callbacks.append(step_checkpoint)
    if cfg["ckpt_every_n_epochs"]:
        callbacks.append(
            ModelCheckpoint(dirpath=out / "ckpt", every_n_epochs=cfg["ckpt_every_n_epochs"], save_top_k=-1)
        )
    if cfg["ckpt_monitor_every_n_steps"]:
        every = cfg["ckpt_monitor_every_n_steps"]
        callbacks.append(
            ModelCheckpoint(
                dirpath=out / "ckpt",
                filename="best-{step}",
                monitor="val_loss",
                every_n_train_steps=every,
                save_top_k=-1,
            )
        )
    # always there (inactive at 0): the checkpoints of a killed run and of the uninterrupted one name their callbacks
    # by position (the rest of an on_train_batch_end), and a real job's restart has the same callbacks
    callbacks.append(Killer(cfg["kill_after_batches"]))
    if cfg["on_exception_ckpt"]:
        callbacks.append(OnExceptionCheckpoint(dirpath=out / "ckpt"))
    if cfg["signal_self"]:
        callbacks.append(SignalSelf(cfg["signal_self"]))
    if cfg["reached_marker_at"]:
        callbacks.append(ReachedMarker(out, cfg["reached_marker_at"]))
    if cfg["draw_at_batch_start"]:
        callbacks.append(DrawAtBatchStart())
    if cfg["rank_early_stopping"]:
        from lightning.pytorch.callbacks import EarlyStopping

        callbacks += [RankMetric(), EarlyStopping(monitor="val_rank", mode="min", patience=1)]
    if cfg["raise_in_batch"] or cfg["save_in_batch"]:
        callbacks.append(InBatch(cfg))
    if cfg["slurm"] is not None:  # last, and in every run of a case (its resume too): callbacks are named by position
        callbacks.append(RequeueSignal(cfg["slurm"]["batch"], cfg["slurm"].get("validation", False)))
    val = cfg["val"]
    strategy: Any = cfg["strategy"]
    sharded = cfg["sharded"]
    if sharded:
        from lightning.pytorch.strategies import ModelParallelStrategy

        from lightning_repro import ReproModelParallelStrategy

        kind = ModelParallelStrategy if sharded.get("plain") else ReproModelParallelStrategy
        strategy = kind(
            data_parallel_size=sharded["dp"],
            tensor_parallel_size=sharded.get("tp", 1),
            save_distributed_checkpoint=sharded.get("layout", "distributed") == "distributed",
        )
    if cfg["ddp_kwargs"]:
        from lightning.pytorch.strategies import DDPStrategy

        from lightning_repro import ReproDDPStrategy

        strategy = {"ddp_repro": ReproDDPStrategy, "ddp": DDPStrategy}[strategy](**cfg["ddp_kwargs"])
    logger: Any = CSVLogger(out / "logs", name="", version="") if cfg["csv_logger"] else False
    trainer_options: dict[str, Any] = dict(
        accelerator=cfg["accelerator"],
        devices=cfg["devices"],
        num_nodes=cfg["num_nodes"],
        strategy=strategy,
        precision=cfg["precision"],
        max_epochs=cfg["max_epochs"],
        max_steps=cfg["max_steps"],
        logger=scenario_features.logger(cfg, out) if features else logger,
        default_root_dir=out,  # the run's folder: the manifest file goes there, not in the working directory
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(
            cfg["ckpt_every_n_steps"]
            or cfg["ckpt_every_n_epochs"]
            or cfg["ckpt_monitor_every_n_steps"]
            or cfg["on_exception_ckpt"]
        ),
        callbacks=callbacks,
        deterministic=cfg["deterministic"] if not cfg["repro"] else None,
        accumulate_grad_batches=cfg["accumulate"],
        limit_val_batches=0 if val == "off" else 1.0,
        val_check_interval=val if isinstance(val, (int, float)) else 1.0,
        num_sanity_val_steps=2,
        limit_train_batches=cfg["limit_train_batches"],
        reload_dataloaders_every_n_epochs=1 if cfg["reload_every_epoch"] else 0,
    )
    if cfg["log_every_n_steps"] is not None:
        trainer_options["log_every_n_steps"] = cfg["log_every_n_steps"]
    if features:  # other Trainer options, over the scenario's
        trainer_options.update(scenario_features.options(cfg)["trainer"])
    trainer = pl.Trainer(**trainer_options)
    if model is None:
        with trainer.init_module(empty_init=True):
            model = model_cls(cfg)
    train, valid = loaders(cfg)
    if cfg["pipeline"] and cfg["pipeline"].get("val_nodes"):  # validation on a torchdata.nodes Loader of its own
        valid = streaming_pipelines.train_loader({**cfg, "num_workers": 1}, 0, 1)
    if cfg["pipeline"] and cfg["pipeline"].get("val_persistent"):  # validation on the pipeline, shuffled, read by 2
        # persistent workers (their copies count the pipeline's passes on their own: litdata's epoch, detshuffle's)
        valid = streaming_pipelines.train_loader(
            {**cfg, "batch_size": 8, "num_workers": 2, "persistent_workers": True}, 0, 1
        )
    datamodule, tuned = None, {}
    if features:
        train = scenario_features.train_data(cfg, loaders)
        if scenario_features.options(cfg)["tuner"]:  # the tuner (or its callback) changes the datamodule's loaders
            datamodule, train, valid = scenario_features.ScenarioData(cfg, loaders), None, None
            tuned = scenario_features.tune(trainer, model, datamodule, cfg)
    if cfg["reload_every_epoch"] or cfg["pipeline"]:
        train = None  # Lightning calls model.train_dataloader() (again every epoch with reload_every_epoch)
    if datamodule is not None:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg["resume"] or None)
    else:
        trainer.fit(model, train_dataloaders=train, val_dataloaders=valid, ckpt_path=cfg["resume"] or None)
    if cfg["save_at_end"]:
        trainer.save_checkpoint(cfg["save_at_end"])
    opt = trainer.optimizers[0]
    result = {
        "params": digest(dict(model.named_parameters())),
        "optimizer": digest(optimizer_tensors(opt)),
        "lr": opt.param_groups[0]["lr"],
        "global_step": trainer.global_step,
        "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
        "epoch": trainer.current_epoch,
        "metrics": {k: float(v).hex() for k, v in sorted(trainer.callback_metrics.items())},
        "cuda_streams": _cuda_streams_in(cfg["save_at_end"]) if trainer.is_global_zero else -1,
        "init": model.init_digest,
        "init_full": model.init_full,
        "hash": hash("some string"),
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "worker_server": WORKER_SERVER[-1] if WORKER_SERVER else None,
        **({"tuned": tuned, "found": scenario_features.found(model, datamodule)} if features else {}),
        **(scenario_features.result(trainer, out) if features else {}),
    }
    if features:  # after the fit's result is taken: predict sets its own up
        scenario_features.predict(trainer, model, cfg, loaders)
    name = "result.json" if trainer.is_global_zero else f"result-rank{trainer.global_rank}.json"
    (out / name).write_text(json.dumps(result, indent=1))
    if trainer.world_size > 1 and trainer.is_global_zero:
        (out / "result-rank0.json").write_text(json.dumps(result, indent=1))
    if cfg["strategy"] == "ddp" and torch.distributed.is_initialized():
        # plain Lightning's gloo group would be left to the interpreter's shutdown (see ReproDDPStrategy)
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
