"""What sample-keyed access costs: plain Lightning vs lightning-repro, side by side in one run.

Two measurements, each alternating plain and ours over several repetitions and comparing medians:

(a) Added cost per sample of sample-keyed access. A cheap dataset whose ``__getitem__`` draws
    from torch, numpy and python ``random`` is iterated in full passes (``num_workers=0``,
    ``batch_size=32``, ``shuffle=True``) through a plain ``DataLoader`` and through the same
    ``DataLoader`` taken over by ``lightning_repro.data.takeover.prepare_dataloader`` (the function
    ``DeterminismCallback`` applies to every train loader). Reported: ``(ours - plain) / samples``
    in microseconds. Target: at most 15 us per sample. Where the seeding kernel writes torch's generator in place
    (``lightning_repro.data.fastrng.TORCH_RAW``), the same loader is also timed with that path switched off for its
    passes (``get_state()``/``set_state()`` of torch's state, as without it: the same values), interleaved.

(b) Step-time ratio on a small model: a small CNN (three conv layers) on 3x32x32 images with the
    usual augmentation (random crop, flip, brightness jitter, noise), batch 64, ``num_workers=0``;
    and, as the worst case, a tiny MLP on 128-d vectors whose step costs almost nothing per sample,
    so the per-sample cost of (a) weighs the most. The target applies to the CNN; the MLP is reported.
    Plain Lightning runs with ``seed_everything(seed, workers=True)`` and ``Trainer(deterministic=True)``; ours with
    ``DeterminismCallback(seed)`` (which turns on the same ``torch.use_deterministic_algorithms``),
    so both use the same kernels. A timing callback records ``on_train_batch_start``; a step is
    the interval between two consecutive batch starts (data fetch, forward, backward, optimizer).
    Trainer construction and imports are outside the timing. Target: median step-time ratio
    ours/plain at most 1.03. A diagnostic third variant, ``DeterminismCallback(seed,
    sample_keyed=False)``, shows how much of the difference is sample-keyed access.

Run::

    python benchmarks/bench_sampling.py           # about 1-2 minutes on 2 CPU cores
    python benchmarks/bench_sampling.py --quick   # a shorter, noisier version

Exit code 0 when both targets are met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset
from workloads import (
    MLP,
    AugmentedDataset,
    CheapDataset,
    ImageDataset,
    SmallCNN,
    StepTimer,
    bare_trainer,
    quiet,
)

from lightning_repro import DeterminismCallback
from lightning_repro.data import fastrng
from lightning_repro.data.takeover import StreamKey, prepare_dataloader

SEED = 42
TARGET_US_PER_SAMPLE = 15.0
TARGET_STEP_RATIO = 1.03


# ------------------------------------------------------------------------------------------ (a)
def _plain_loader(n: int) -> DataLoader[Any]:
    pl.seed_everything(SEED, workers=True, verbose=False)
    return DataLoader(CheapDataset(n), batch_size=32, shuffle=True, num_workers=0)


def _repro_loader(n: int) -> DataLoader[Any]:
    loader = DataLoader(CheapDataset(n), batch_size=32, shuffle=True, num_workers=0)
    return prepare_dataloader(loader, seed=SEED, rank=0, stream=StreamKey("train", 0), counter=lambda: 0)  # type: ignore[no-any-return]


def _time_pass(loader: DataLoader[Any]) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def bench_per_sample(n: int, reps: int) -> dict[str, float]:
    plain, ours = _plain_loader(n), _repro_loader(n)
    raw = fastrng.TORCH_RAW
    loaders = {"plain": plain, "ours": ours, **({"set_state": ours} if raw else {})}
    times: dict[str, list[float]] = {name: [] for name in loaders}
    try:
        for rep in range(reps + 1):  # the first round warms up
            for name in list(loaders) if rep % 2 else list(reversed(loaders)):
                fastrng.TORCH_RAW = raw and name != "set_state"  # timing only: the values are the same either way
                elapsed = _time_pass(loaders[name])
                if rep:
                    times[name].append(elapsed)
    finally:
        fastrng.TORCH_RAW = raw
    plain_s, our_s = statistics.median(times["plain"]), statistics.median(times["ours"])
    result = {
        "plain_us": plain_s / n * 1e6,
        "ours_us": our_s / n * 1e6,
        "added_us": (our_s - plain_s) / n * 1e6,
    }
    if raw:
        result["set_state_added_us"] = (statistics.median(times["set_state"]) - plain_s) / n * 1e6
        result["fastest_added_us"] = (min(times["ours"]) - min(times["plain"])) / n * 1e6
        result["fastest_set_state_added_us"] = (min(times["set_state"]) - min(times["plain"])) / n * 1e6
    return result


# ------------------------------------------------------------------------------------------ (b)
_DIM, _CLASSES, _BATCH = 128, 10, 64


def _trainer(callbacks: list[Callback], steps: int, **kwargs: Any) -> pl.Trainer:
    return bare_trainer(callbacks, max_epochs=1, max_steps=steps, **kwargs)


def _setup(kind: str, steps: int) -> tuple[pl.LightningModule, DataLoader[Any]]:
    if kind == "cnn":
        model: pl.LightningModule = SmallCNN(_CLASSES)
        dataset: Dataset[Any] = ImageDataset(steps * _BATCH, _CLASSES)
    else:
        model, dataset = MLP(_DIM), AugmentedDataset(steps * _BATCH, _DIM, _CLASSES)
    return model, DataLoader(dataset, batch_size=_BATCH, shuffle=True)


def _fit_plain(kind: str, steps: int) -> tuple[list[float], float]:
    pl.seed_everything(SEED, workers=True, verbose=False)
    model, loader = _setup(kind, steps)
    timer = StepTimer()
    trainer = _trainer([timer], steps, deterministic=True)
    start = time.perf_counter()
    trainer.fit(model, loader)
    return timer.step_times(skip=5), time.perf_counter() - start


def _fit_repro(kind: str, steps: int, *, sample_keyed: bool = True) -> tuple[list[float], float]:
    callback = DeterminismCallback(SEED, sample_keyed=sample_keyed)
    model, loader = _setup(kind, steps)
    timer = StepTimer()
    trainer = _trainer([callback, timer], steps)
    start = time.perf_counter()
    trainer.fit(model, loader)
    return timer.step_times(skip=5), time.perf_counter() - start


def bench_steps(kind: str, steps: int, reps: int) -> dict[str, float]:
    runs: dict[str, Callable[[int], tuple[list[float], float]]] = {
        "plain": lambda n: _fit_plain(kind, n),
        "ours": lambda n: _fit_repro(kind, n),
        "unkeyed": lambda n: _fit_repro(kind, n, sample_keyed=False),  # diagnostic: ours without sample-keyed access
    }
    step_medians: dict[str, list[float]] = {name: [] for name in runs}
    fit_times: dict[str, list[float]] = {name: [] for name in runs}
    for fit in runs.values():  # warm-up: first-use costs (lazy imports, allocator) for each
        fit(min(steps, 20))
    for rep in range(reps):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for name in order:
            times, total = runs[name](steps)
            step_medians[name].append(statistics.median(times))
            fit_times[name].append(total)
    plain_step, our_step = statistics.median(step_medians["plain"]), statistics.median(step_medians["ours"])
    plain_fit, our_fit = statistics.median(fit_times["plain"]), statistics.median(fit_times["ours"])
    unkeyed_step = statistics.median(step_medians["unkeyed"])
    return {
        "unkeyed_step_ms": unkeyed_step * 1e3,
        "unkeyed_ratio": unkeyed_step / plain_step,
        "unkeyed_fit_s": statistics.median(fit_times["unkeyed"]),
        "plain_step_ms": plain_step * 1e3,
        "ours_step_ms": our_step * 1e3,
        "step_ratio": our_step / plain_step,
        "plain_fit_s": plain_fit,
        "ours_fit_s": our_fit,
        "fit_ratio": our_fit / plain_fit,
    }


# ------------------------------------------------------------------------------------------ main
def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, steps and repetitions")
    args = parser.parse_args(argv)
    quiet()
    samples, sample_reps = (8192, 5) if args.quick else (32768, 9)
    steps, step_reps = (100, 3) if args.quick else (300, 5)
    cnn_steps = 40 if args.quick else 100

    print(f"torch {torch.__version__}, lightning {pl.__version__}, {torch.get_num_threads()} threads,", end=" ")
    print(f"{os.cpu_count()} CPUs, seed {SEED}{', --quick' if args.quick else ''}")
    print("plain   = lightning.pytorch.seed_everything(seed, workers=True), no callback")
    print("ours    = DeterminismCallback(seed): sample-keyed access, restored process streams after each batch")

    t0 = time.perf_counter()
    a = bench_per_sample(samples, sample_reps)
    print()
    print(f"(a) sample-keyed access: {samples} samples per pass, batch 32, num_workers=0,", end=" ")
    print(f"median of {sample_reps} interleaved passes each")
    print(f"    {'':24}{'plain':>12}{'ours':>12}")
    print(f"    {'time per sample':24}{a['plain_us']:>10.2f}us{a['ours_us']:>10.2f}us")
    ok_a = a["added_us"] <= TARGET_US_PER_SAMPLE
    target_a = f"target <= {TARGET_US_PER_SAMPLE:g} us"
    print(f"    added cost per sample: {a['added_us']:.2f} us ({target_a})  {_verdict(ok_a)}")
    if "set_state_added_us" in a:
        print(
            f"    torch's generator written in place by the kernel: {a['added_us']:.2f} us added (fastest passes"
            f" {a['fastest_added_us']:.2f}); through get_state()/set_state(): {a['set_state_added_us']:.2f} us"
            f" (fastest {a['fastest_set_state_added_us']:.2f})"
        )

    results = {}
    for kind, title, kind_steps in (
        ("cnn", "small CNN (3 conv layers, 32-64-128) on 3x32x32 images with crop/flip/jitter/noise", cnn_steps),
        ("mlp", f"tiny MLP {_DIM}->256->256->256->{_CLASSES} on vectors (worst case: ~no compute per sample)", steps),
    ):
        b = bench_steps(kind, kind_steps, step_reps)
        results[kind] = b
        print()
        print(f"(b) {title}")
        print(f"    batch {_BATCH}, num_workers=0, {kind_steps} steps, median of {step_reps} alternating fits;")
        print("    both use torch.use_deterministic_algorithms(True) (plain via Trainer(deterministic=True))")
        print(f"    {'':24}{'plain':>12}{'ours':>12}{'ours/plain':>12}")
        step, fit = "median step", "trainer.fit wall time"
        print(f"    {step:24}{b['plain_step_ms']:>10.3f}ms{b['ours_step_ms']:>10.3f}ms{b['step_ratio']:>12.3f}")
        print(f"    {fit:24}{b['plain_fit_s']:>11.3f}s{b['ours_fit_s']:>11.3f}s{b['fit_ratio']:>12.3f}")
        added_ms = b["ours_step_ms"] - b["plain_step_ms"]
        print(f"    added per step: {added_ms:.3f} ms = {added_ms * 1e3 / _BATCH:.1f} us per sample of the batch")
        print(f"    diagnostic, ours with sample_keyed=False: ratio {b['unkeyed_ratio']:.3f}")
    if a["added_us"] > 0:
        needed_ms = a["added_us"] * _BATCH / 1e3 / (TARGET_STEP_RATIO - 1)
        print()
        print(
            f"    at the added cost per sample of (a), a step of {_BATCH} samples loaded in the main process must take"
            f" at least {needed_ms:.1f} ms for a ratio <= {TARGET_STEP_RATIO} (with num_workers > 0 the cost runs"
            " in the workers)"
        )
    ok_b = results["cnn"]["step_ratio"] <= TARGET_STEP_RATIO
    print(
        f"    step-time ratio on the small CNN: {results['cnn']['step_ratio']:.3f} (target <= {TARGET_STEP_RATIO})"
        f"  {_verdict(ok_b)};  tiny MLP: {results['mlp']['step_ratio']:.3f} (reported, no target)"
    )
    print()
    print(f"total benchmark time {time.perf_counter() - t0:.1f} s;  overall {_verdict(ok_a and ok_b)}")
    return 0 if ok_a and ok_b else 1


if __name__ == "__main__":
    sys.exit(main())
