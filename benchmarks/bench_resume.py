"""How long a mid-epoch resume takes to reach its first batch, for 10 and for 100,000 skipped batches.

The dataset is slow (``__getitem__`` sleeps 2 ms) and big (800,000 samples generated from the
index, batch size 4: 200,000 batches per epoch), so replaying the skipped batches would be
expensive. lightning-repro skips them at the index level: the first resumed batch is sliced
from the epoch's permutation.

What the script does, all in one process:

1. trains 10 steps with ``DeterminismCallback`` (``max_steps=10``) and writes a real checkpoint
   with ``trainer.save_checkpoint``; the same with plain Lightning (``seed_everything(workers=True)``,
   ``deterministic=True``);
2. runs the same training uninterrupted for 11 steps, recording every batch (the reference);
3. synthesizes a checkpoint 100,000 batches into the epoch from each real one by rewriting its counters
   consistently: Lightning's batch progress, optimizer-step progress, ``_batches_that_stepped`` and ``global_step``,
   and in ours the entry's ``data[0]["offset"]`` and ``batches`` and the restore check's digest of the data
   position (recomputed as a save computes it, so the restore check runs and must pass; the model and the RNG
   streams stay those of step 10; the optimizer is plain SGD, so it has no step-dependent state);
4. resumes from each checkpoint several times, ours and plain interleaved, and measures the time from calling
   ``trainer.fit(model, ckpt_path=...)`` to ``on_train_batch_start`` of the first resumed batch (ours: loading,
   the run manifest, the restore check and the skip at the index level; plain Lightning does not skip: it starts
   the epoch's loader again);
5. checks that the first resumed batch is the batch an uninterrupted pass has at that position:
   for 10 skipped batches against the real uninterrupted run (indices and augmented contents),
   for 100,000 against the epoch order of a fresh pass of the same loader taken over by
   ``prepare_dataloader`` (that reference is itself checked against the real run's first 11
   batches), and that every resume of ours said "restore verified";
6. measures what replaying costs instead (plain ``DataLoader``, loading 200 batches, extrapolated
   to 100,000), the size of our checkpoint entry, and that ``torch.load(weights_only=True)``
   reads both checkpoints.

Targets: time ratio (100,000 skipped) / (10 skipped) at most 1.2; ours minus plain at most 50 ms at both positions
(median of the interleaved pairs; issue 21); our entry at most 32 KiB.

Run::

    python benchmarks/bench_resume.py           # about 1 minute on 2 CPU cores
    python benchmarks/bench_resume.py --quick   # fewer repetitions

Exit code 0 when every target and check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_repro import DeterminismCallback
from lightning_repro.checkpoint.entry import seal_entry
from lightning_repro.checkpoint.verify import _saved_position, digest_value
from lightning_repro.data.takeover import StreamKey, prepare_dataloader

SEED = 42
BATCH = 4
DELAY_S = 0.002
SHORT = 10  # batches consumed in the real checkpoint
LONG = 100_000  # batches consumed in the synthesized checkpoint
BATCHES_PER_EPOCH = 200_000
TARGET_RATIO = 1.2
TARGET_ENTRY_BYTES = 32 * 1024
TARGET_ADDED_S = 0.050
ENTRY_KEY = "DeterminismCallback"


class SlowDataset(Dataset):  # type: ignore[type-arg]
    """A big, slow dataset holding no data: sample ``i`` is generated from ``i`` plus augmentation."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.delay:
            time.sleep(self.delay)  # stands for decoding an image from disk
        base = torch.full((8,), (i % 9973) / 9973.0)
        noise = 0.1 * torch.randn(8) + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return base + noise, i


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class BatchRecorder(Callback):
    """Records the time of the first ``on_train_batch_start`` and every batch's indices and contents."""

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.first_position: tuple[int, int] | None = None  # (batch_idx, global_step) of the first batch
        self.batches: list[tuple[list[int], str]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.first_start is None:
            self.first_start = time.perf_counter()
            self.first_position = (idx, trainer.global_step)
        self.batches.append(_describe(batch))


def _describe(batch: Any) -> tuple[list[int], str]:
    """(sample indices, SHA-256 of the augmented inputs) of a collated batch."""
    x, indices = batch
    return [int(i) for i in indices], hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


def _loader(delay: float = DELAY_S) -> DataLoader[Any]:
    return DataLoader(SlowDataset(BATCH * BATCHES_PER_EPOCH, delay), batch_size=BATCH, shuffle=True, num_workers=0)


class _Verified(logging.Handler):
    """Counts the restore check's "restore verified" lines (logged at INFO by ``lightning_repro``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "restore verified" in record.getMessage()


VERIFIED = _Verified()


class _SaveAt(Callback):
    """Saves a checkpoint after the batch of optimizer step ``step``, as ``ModelCheckpoint(every_n_train_steps)``.

    Plain Lightning's checkpoint written after ``fit`` ended (``max_steps``) holds a finished epoch: resuming from it
    trains nothing. Ours corrects that; plain Lightning's mid-fit checkpoint is the fair counterpart.
    """

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(
    max_steps: int, ckpt_path: Path | None = None, save_to: Path | None = None, plain: bool = False
) -> tuple[BatchRecorder, float]:
    """One fit with DeterminismCallback (or plain Lightning); the recorder and seconds from fit() to the first batch."""
    callback = None if plain else DeterminismCallback(SEED)
    if plain:
        pl.seed_everything(SEED, workers=True, verbose=False)
    model, recorder = TinyModel(), BatchRecorder()
    callbacks: list[Callback] = [recorder] if callback is None else [callback, recorder]
    if plain and save_to is not None:  # a mid-fit checkpoint at step max_steps (see _SaveAt)
        callbacks.append(_SaveAt(max_steps, save_to))
        max_steps, save_to = max_steps + 1, None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        deterministic=True if plain else None,
        callbacks=callbacks,
    )

    loader = _loader()
    start = time.perf_counter()
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    if ckpt_path is not None and callback is not None and not callback.restored:
        raise RuntimeError(f"DeterminismCallback did not restore its state from {ckpt_path}")
    assert recorder.first_start is not None
    return recorder, recorder.first_start - start


def _shift(progress: dict[str, Any], delta: int) -> None:
    """Add ``delta`` to every counter of a Lightning progress dict (nested dicts of ints)."""
    for key, value in progress.items():
        if isinstance(value, dict):
            _shift(value, delta)
        elif isinstance(value, int) and not isinstance(value, bool):
            progress[key] = value + delta


def synthesize(real: Path, target: Path, consumed: int) -> dict[str, Any]:
    """Write a copy of the real checkpoint that says ``consumed`` batches of the epoch were trained."""
    checkpoint = torch.load(real, weights_only=True)
    delta = consumed - checkpoint["global_step"]
    fit_loop = checkpoint["loops"]["fit_loop"]
    _shift(fit_loop["epoch_loop.batch_progress"], delta)
    _shift(fit_loop["epoch_loop.automatic_optimization.optim_progress"], delta)
    fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"] += delta
    checkpoint["global_step"] += delta
    entry = checkpoint.get("callbacks", {}).get(ENTRY_KEY)
    if entry is not None:
        part = entry["ranks"][0]  # rank 0's part (entry version 2)
        part["batches"] += delta
        part["data"][0]["offset"] += delta
        # the restore check's digest of the data position, as a save at that position computes it
        part["restore_sha256"]["data position"] = digest_value(_saved_position(part["data"]))
        seal_entry(entry)  # the entry's SHA-256 covers what was edited
    torch.save(checkpoint, target)
    return checkpoint


def reference_batches(positions: list[int]) -> list[tuple[list[int], str]]:
    """Batches at ``positions`` of a fresh, uninterrupted first pass of epoch 0, as lightning-repro orders and
    keys them: walk the pass's order and load only the wanted batches."""
    loader = prepare_dataloader(_loader(delay=0.0), seed=SEED, rank=0, stream=StreamKey("train", 0), counter=lambda: 0)
    wanted, found = set(positions), {}
    for position, item in enumerate(loader.batch_sampler):
        if position in wanted:
            # load exactly this batch through the same (taken-over) dataset and collate function
            single = DataLoader(loader.dataset, batch_sampler=[item], collate_fn=loader.collate_fn)
            found[position] = _describe(next(iter(single)))
            if len(found) == len(wanted):
                break
    return [found[p] for p in positions]


def replay_seconds(batches: int) -> float:
    """Time to load ``batches`` batches through a plain DataLoader: what replaying a skip costs."""
    pl.seed_everything(SEED, workers=True, verbose=False)
    iterator = iter(_loader())
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return time.perf_counter() - start


def _entry_bytes(checkpoint: dict[str, Any]) -> int:
    buffer = io.BytesIO()
    torch.save(checkpoint["callbacks"][ENTRY_KEY], buffer)
    return buffer.getbuffer().nbytes


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    # Lightning's hints that do not apply here (num_workers=0, resuming mid-epoch is the point),
    # litlogger, a deprecated pytree API it calls; ours about PYTHONHASHSEED (no hashing involved)
    warnings.filterwarnings(
        "ignore", message=r".*(num_workers|litlogger|LeafSpec|PYTHONHASHSEED|before the epoch ended).*"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and replayed batches")
    args = parser.parse_args(argv)
    _quiet()
    reps, replay_batches = (3, 50) if args.quick else (9, 200)
    started = time.perf_counter()
    checks: list[tuple[str, bool]] = []

    logging.getLogger("lightning_repro").setLevel(logging.INFO)
    logging.getLogger("lightning_repro").addHandler(VERIFIED)
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {(run, skip): Path(tmp, f"{run}-{skip}.ckpt") for run in ("ours", "plain") for skip in (SHORT, LONG)}
        short_ckpt, long_ckpt = ckpts["ours", SHORT], ckpts["ours", LONG]
        print(f"dataset: {BATCH * BATCHES_PER_EPOCH:,} samples generated from the index, __getitem__ sleeps", end=" ")
        print(f"{DELAY_S * 1e3:g} ms, batch {BATCH} -> {BATCHES_PER_EPOCH:,} batches per epoch, num_workers=0")

        interrupted, _ = _fit(max_steps=SHORT, save_to=short_ckpt)
        _fit(max_steps=SHORT, save_to=ckpts["plain", SHORT], plain=True)
        uninterrupted, _ = _fit(max_steps=SHORT + 1)
        same_start = interrupted.batches == uninterrupted.batches[:SHORT]
        checks.append((f"the interrupted and uninterrupted runs agree on batches 0-{SHORT - 1}", same_start))
        real = torch.load(short_ckpt, weights_only=True)  # raises if the checkpoint needs unpickling
        synthesized = synthesize(short_ckpt, long_ckpt, LONG)
        synthesize(ckpts["plain", SHORT], ckpts["plain", LONG], LONG)
        torch.load(long_ckpt, weights_only=True)
        checks.append(("torch.load(path, weights_only=True) loads both checkpoints", True))
        print(
            f"checkpoint 1 (real): written by trainer.save_checkpoint after max_steps={SHORT};"
            f" entry data offset {real['callbacks'][ENTRY_KEY]['ranks'][0]['data'][0]['offset']}"
        )
        print(
            f"checkpoint 2 (SYNTHESIZED from checkpoint 1, not trained): counters rewritten to {LONG:,} consumed"
            f" batches (entry offset {synthesized['callbacks'][ENTRY_KEY]['ranks'][0]['data'][0]['offset']:,},"
            f" global_step {synthesized['global_step']:,}); plain Lightning's two checkpoints alike"
        )

        # expected first batches: the real uninterrupted run for SHORT, a fresh pass's order for LONG
        reference = reference_batches([*range(SHORT + 1), LONG])
        same_reference = reference[: SHORT + 1] == uninterrupted.batches
        checks.append((f"the reference order == the real uninterrupted run, batches 0-{SHORT}", same_reference))
        expected = {SHORT: uninterrupted.batches[SHORT], LONG: reference[-1]}

        times: dict[tuple[str, int], list[float]] = {key: [] for key in ckpts}
        firsts: dict[int, list[tuple[list[int], str]]] = {SHORT: [], LONG: []}
        positions: dict[int, set[tuple[int, int] | None]] = {SHORT: set(), LONG: set()}
        order = list(ckpts)
        VERIFIED.count = 0
        for rep in range(reps):
            for setup, skip in order if rep % 2 == 0 else reversed(order):
                plain = setup == "plain"
                recorder, seconds = _fit(max_steps=skip + 1, ckpt_path=ckpts[setup, skip], plain=plain)
                times[setup, skip].append(seconds)
                if not plain:
                    firsts[skip].append(recorder.batches[0])
                    positions[skip].add(recorder.first_position)
        verified = VERIFIED.count == 2 * reps
        checks.append((f"the restore check ran and verified every resume of ours ({2 * reps})", verified))
        for skip in (SHORT, LONG):
            same = all(first == expected[skip] for first in firsts[skip])
            source = "the real uninterrupted run" if skip == SHORT else "a fresh pass's order (reference)"
            checks.append((f"first batch after {skip:,} skipped == batch {skip:,} of {source}", same))
            checks.append((f"it runs as batch_idx {skip:,} at global_step {skip:,}", positions[skip] == {(skip, skip)}))

        short_s, long_s = statistics.median(times["ours", SHORT]), statistics.median(times["ours", LONG])
        ratio = long_s / short_s
        added = {k: [o - p for o, p in zip(times["ours", k], times["plain", k], strict=True)] for k in (SHORT, LONG)}
        added_ok = all(statistics.median(added[skip]) <= TARGET_ADDED_S for skip in (SHORT, LONG))
        replay = replay_seconds(replay_batches)
        per_batch = replay / replay_batches
        entry_bytes = _entry_bytes(real)

    print()
    print(f"time from trainer.fit(ckpt_path=...) to the first resumed batch (median of {reps}, alternating;")
    print("  includes loading the checkpoint, the epoch's permutation and fetching the first batches):")
    print(f"  {SHORT:>7,} skipped batches (real checkpoint)          {short_s * 1e3:9.1f} ms")
    print(f"  {LONG:>7,} skipped batches (synthesized checkpoint)   {long_s * 1e3:9.1f} ms")
    print(f"  ratio {ratio:.3f} (target <= {TARGET_RATIO})  {_verdict(ratio <= TARGET_RATIO)}")
    for skip in (SHORT, LONG):
        plain_ms = statistics.median(times["plain", skip]) * 1e3
        spread = ", ".join(f"{a * 1e3:+.1f}" for a in sorted(added[skip]))
        print(
            f"  plain Lightning at {skip:>7,} (no skip: it starts the epoch's loader again) {plain_ms:9.1f} ms;"
            f" ours minus plain {statistics.median(added[skip]) * 1e3:+.1f} ms (pairs: {spread})"
        )
    print(f"  ours minus plain at most {TARGET_ADDED_S * 1e3:g} ms at both positions  {_verdict(added_ok)}")
    print(
        "a naive skip instead (iterate a plain DataLoader, loading the skipped batches):"
        f" {per_batch * 1e3:.2f} ms per batch, measured over {replay_batches} batches"
    )
    print(f"  -> {LONG:,} skipped batches: {per_batch * LONG:,.0f} s (extrapolated, not measured)")
    print(
        f"our bytes per rank in the checkpoint: {entry_bytes:,} B ({entry_bytes / 1024:.1f} KiB;"
        f" target <= {TARGET_ENTRY_BYTES // 1024} KiB)  {_verdict(entry_bytes <= TARGET_ENTRY_BYTES)}"
    )
    print()
    print("checks:")
    for name, ok in checks:
        print(f"  {_verdict(ok)}  {name}")
    for skip in (SHORT, LONG):
        print(f"  first batch after {skip:,} skipped: sample indices {expected[skip][0]}")
    ok = ratio <= TARGET_RATIO and added_ok and entry_bytes <= TARGET_ENTRY_BYTES and all(ok for _, ok in checks)
    print()
    print(f"total benchmark time {time.perf_counter() - started:.1f} s;  overall {_verdict(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
