"""lightning-repro: bit-for-bit reproducible PyTorch Lightning training, and the proof of it."""

from __future__ import annotations

from lightning_repro.callback import DeterminismCallback
from lightning_repro.data.samplers import ReproBatchSampler
from lightning_repro.exceptions import (
    CheckpointReadError,
    CorruptStateError,
    DivergenceError,
    EnvironmentDriftError,
    InputError,
    NondeterminismWarning,
    NotExactWarning,
    ReproError,
    ReproWarning,
    RestoreError,
    SeedMismatchError,
    SeedRunError,
    TopologyError,
)
from lightning_repro.manifest.collect import collect_manifest
from lightning_repro.manifest.fingerprint import digest_tensors, environment_fingerprint
from lightning_repro.rng import capture_process_streams, fork_process_streams, restore_process_streams
from lightning_repro.seeding import derive_seed, seed_everything
from lightning_repro.stats.seeds import BandCheck, SeedReport, check_band, run_seeds
from lightning_repro.strategies.ddp import ReproDDPStrategy, register_strategy
from lightning_repro.strategies.sharded import (
    ReproFSDPStrategy,
    ReproModelParallelStrategy,
    register_sharded_strategies,
)
from lightning_repro.trace import Trace, TraceDiff, TraceRecord, diff_traces, read_trace

register_strategy()  # Trainer(strategy="ddp_repro"); safe to repeat
register_sharded_strategies()  # Trainer(strategy="model_parallel_repro" or "fsdp_repro"); safe to repeat

__all__ = [
    "BandCheck",
    "CheckpointReadError",
    "CorruptStateError",
    "DeterminismCallback",
    "DivergenceError",
    "EnvironmentDriftError",
    "InputError",
    "NondeterminismWarning",
    "NotExactWarning",
    "ReproBatchSampler",
    "ReproDDPStrategy",
    "ReproError",
    "ReproFSDPStrategy",
    "ReproModelParallelStrategy",
    "ReproWarning",
    "RestoreError",
    "SeedMismatchError",
    "SeedReport",
    "SeedRunError",
    "TopologyError",
    "Trace",
    "TraceDiff",
    "TraceRecord",
    "__version__",
    "capture_process_streams",
    "check_band",
    "collect_manifest",
    "derive_seed",
    "diff_traces",
    "digest_tensors",
    "environment_fingerprint",
    "fork_process_streams",
    "read_trace",
    "register_sharded_strategies",
    "register_strategy",
    "restore_process_streams",
    "run_seeds",
    "seed_everything",
]

__version__ = "0.1.0"
