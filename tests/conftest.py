from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import runner
from hypothesis import settings

from lightning_repro.manifest import MANIFEST_FILE

# CI must not fail once by chance: no per-example deadline (a loaded 2-core machine stalls), the same examples on
# every run (derandomized: a failure is reproduced by rerunning), and no example database written into the checkout
settings.register_profile("repro", deadline=None, derandomize=True, database=None)
settings.load_profile("repro")


_CACHE_MADE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # the manifest hashes untracked files of a dirty checkout through a digest cache: keep it out of ~/.cache
    if "LIGHTNING_REPRO_CACHE" not in os.environ:
        _CACHE_MADE.append(tempfile.mkdtemp(prefix="lightning-repro-cache-"))
        os.environ["LIGHTNING_REPRO_CACHE"] = _CACHE_MADE[-1]


def pytest_unconfigure(config: pytest.Config) -> None:
    # the folder this process made goes when it ends (each xdist worker and the controller make their own)
    for folder in _CACHE_MADE:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("LIGHTNING_REPRO_CACHE", None)


# pytest-xdist (--dist loadfile --no-loadscope-reorder) hands out whole files in this order: the longest first, so the
# two workers finish together; then the files with slow tests, then the rest, each group in collection order
LONGEST_FIRST = (
    # the marked tests' run (scripts/test.sh), measured on 2026-12-07 (seconds of each file's tests, the two workers
    # sharing 2 cores): about 180, 150, 145, 145, 105, 95, then 50 to 7 (the files after them run in the same order);
    # a long file left to the end keeps one worker busy while the other waits (test_streaming.py, 44 s, was last)
    "test_streaming_libs_ddp.py",
    "test_ddp.py",
    "test_streaming_libs.py",
    "test_sharded.py",
    "test_lightning_features.py",
    "test_streaming_libs_epochs.py",
    "test_ddp_workers.py",
    "test_streaming.py",
    "test_sharded_topology.py",
    "test_ordinary_project.py",  # in both runs
    "test_sharded_prestep.py",
    "test_slurm_requeue.py",  # in both runs
    "test_ddp_torchrun.py",
    "test_ddp_buffers.py",
    "test_ddp_nodes.py",
    "test_inflight.py",
    "test_ddp_validation.py",
    # the main suite's: about 170, 80, 80, 65, 50, 40 and 40 s (test_ordinary_project.py and test_streaming.py above)
    "test_resume.py",
    "test_continue_fit.py",
    "test_torchdata_nodes.py",
    "test_determinism.py",
    "test_stats.py",
    "test_accumulate_checkpoints.py",
)


def _schedule(items: list[pytest.Item]) -> None:
    slow_files = {item.path.name for item in items if "slow" in item.keywords}

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(name)
        return (1, 0) if name in slow_files else (2, 0)

    items.sort(key=rank)  # stable: each file's tests keep their order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _schedule(items)
    if any("slow" in item.keywords for item in items):
        runner.start_fork_server()  # its imports overlap the fast tests that run first
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_global_state() -> Iterator[None]:
    """Put back RNG states, determinism flags, cuDNN flags and environment variables after each test."""
    py, npy, tch = random.getstate(), np.random.get_state(), torch.get_rng_state()
    det, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    env = dict(os.environ)
    yield
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(tch)
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(autouse=True)
def _no_manifest_in_the_working_directory() -> Iterator[None]:
    """A run without a logger writes its manifest to its ``default_root_dir``: tests give each run its own folder."""
    path = Path.cwd() / MANIFEST_FILE
    existed = path.exists()
    yield
    assert existed or not path.exists(), f"a run wrote {path}: give its Trainer a default_root_dir"


class RunCache:
    """Runs scenarios in fresh processes; identical configs (uninterrupted references) run once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, dict[str, Any]] = {}
        self._count = 0

    def fresh_dir(self, name: str) -> str:
        self._count += 1
        path = self.root / f"{self._count:03d}-{name}"
        shutil.rmtree(path, ignore_errors=True)
        return str(path)

    def reference(self, cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
        key = repr(sorted(cfg.items()))
        if key not in self._cache:
            out = self.fresh_dir("ref")
            self._cache[key] = {"result": runner.run({**cfg, "out": out}), "out": out}
        hit = self._cache[key]
        return hit["result"], hit["out"]

    def run(self, cfg: dict[str, Any], name: str, **kwargs: Any) -> tuple[dict[str, Any], str]:
        out = self.fresh_dir(name)
        return runner.run({**cfg, "out": out}, **kwargs), out

    def resumed_in_place(
        self, cfg: dict[str, Any], kill_after: int, at: tuple[int, int]
    ) -> tuple[dict[str, Any], str, dict[str, Any], str]:
        """The uninterrupted run of ``cfg``; a run SIGKILLed after ``kill_after`` batches whose ``last.ckpt`` is at
        ``at`` (step, batches), resumed from it in a fresh process in its own folder; and every checkpoint file the
        two folders hold compared (the run manifest's code section and the entry's seal left out). Returns
        ``(reference, its folder, resumed, its folder)``."""
        reference, ref_out = self.reference(cfg)
        _, out = self.run({**cfg, "kill_after_batches": kill_after}, "killed", expect_kill=True)
        last = Path(out, "ckpt", "last.ckpt")
        assert runner.checkpoint_position(last)[:2] == at
        resumed = runner.run({**cfg, "out": out, "resume": str(last)})
        ignored = ("/callbacks/DeterminismCallback/manifest/code/", "/callbacks/DeterminismCallback/entry_sha256")
        problems = runner.compare_checkpoint_files(ref_out, out, ignore=ignored)
        assert not problems, "\n".join(problems)
        return reference, ref_out, resumed, out

    def killed(self, cfg: dict[str, Any]) -> str:
        """The folder of a run killed after a checkpoint (``kill_after_batches``), run once per session for its
        config: several tests resume it differently (they only read its directory)."""
        key = repr(("killed", sorted(cfg.items())))
        if key not in self._cache:
            self._cache[key] = {"out": self.run(cfg, "killed", expect_kill=True)[1]}
        return str(self._cache[key]["out"])

    def ddp(self, cfg: dict[str, Any], name: str, **kwargs: Any) -> tuple[dict[str, Any], str]:
        out = self.fresh_dir(name)
        return runner.run_ddp({**cfg, "out": out}, **kwargs), out

    def ddp_reference(
        self, cfg: dict[str, Any], launcher: str = "lightning", *, expect_kill: bool = False
    ) -> tuple[dict[str, Any], str]:
        """A DDP job run once per session for its config: an uninterrupted reference, or (``expect_kill``) a job
        killed after a checkpoint that several tests resume differently (they only read its directory)."""
        if not cfg.get("num_workers"):
            cfg = {k: v for k, v in cfg.items() if k != "mp_context"}  # no workers: the start method is moot
        key = repr(("ddp", launcher, expect_kill, sorted(cfg.items())))
        if key not in self._cache:
            name = "ddp-killed" if expect_kill else "ddp-ref"
            result, out = self.ddp(cfg, name, launcher=launcher, expect_kill=expect_kill)
            self._cache[key] = {"result": result, "out": out}
        hit = self._cache[key]
        return hit["result"], hit["out"]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("runs"))
