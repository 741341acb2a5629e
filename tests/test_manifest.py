"""The run manifest: its sections, the data digest cache, git state, drift on resume and ``lightning-repro env``."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helpers
import lightning
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import (
    DeterminismCallback,
    EnvironmentDriftError,
    NotExactWarning,
    ReproWarning,
    collect_manifest,
    environment_fingerprint,
)
from lightning_repro.checkpoint.entry import Entry, seal_entry
from lightning_repro.cli.main import main
from lightning_repro.exceptions import CorruptStateError
from lightning_repro.manifest import datahash
from lightning_repro.manifest.codestate import code_manifest
from lightning_repro.manifest.collect import MANIFEST_FILE
from lightning_repro.manifest.fingerprint import CPU_FIELDS, blas_build, cpu_model, cpu_vendor

KEY = "DeterminismCallback"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test with its own digest cache (not the user's ``~/.cache``)."""
    monkeypatch.setenv("LIGHTNING_REPRO_CACHE", str(tmp_path / "cache"))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)


def _fit(tmp_path: Path, ckpt: Path | None = None, **options: Any) -> tuple[pl.Trainer, DeterminismCallback]:
    callback = DeterminismCallback(seed=5, **options)
    trainer = helpers.fast_trainer([callback], max_steps=4 if ckpt else 2, default_root_dir=tmp_path)
    trainer.fit(Tiny(), _data(), ckpt_path=ckpt)
    return trainer, callback


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    trainer, _ = _fit(tmp_path)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return path


def _resealed(path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the checkpoint whose entry ``edit`` changed in place, re-sealed."""
    saved = torch.load(path, weights_only=True)
    edit(saved["callbacks"][KEY])
    seal_entry(saved["callbacks"][KEY])
    target = path.with_name(f"doctored-{len(list(path.parent.glob('doctored-*')))}.ckpt")
    torch.save(saved, target)
    return target


def _doctor(path: Path, **changes: Any) -> Path:
    """A copy of the checkpoint whose entry manifest has ``changes`` ("section.field": value), re-sealed."""

    def edit(entry: dict[str, Any]) -> None:
        for name, value in changes.items():
            section, field = name.split(".")
            entry["manifest"][section][field] = value

    return _resealed(path, edit)


# ---------------------------------------------------------------------------------------- the sections
def test_versions_are_the_interpreters() -> None:
    manifest = collect_manifest(seed=9)
    environment = manifest["environment"]
    assert environment["python"] == platform.python_version()
    assert environment["torch"] == str(torch.__version__)
    assert environment["lightning"] == lightning.__version__
    assert environment["numpy"] == np.__version__
    assert environment["torchmetrics"] == torchmetrics.__version__
    assert environment["cuda"] == torch.version.cuda
    assert environment["num_threads"] == torch.get_num_threads()
    assert manifest["seeds"]["seed"] == 9
    assert manifest["hardware"]["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert json.loads(json.dumps(manifest)) == manifest  # plain JSON values only


def test_image_digest_is_read_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_REPRO_IMAGE_DIGEST", "sha256:abc")
    assert collect_manifest()["environment"]["image_digest"] == "sha256:abc"


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="`on_env_drift` must be 'warn' or 'error', got 'never'"):
        DeterminismCallback(seed=1, on_env_drift="never")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`data_paths` must be a list"):
        DeterminismCallback(seed=1, data_paths="data/train")
    with pytest.raises(TypeError, match="`data_fingerprint` must be a str"):
        DeterminismCallback(seed=1, data_fingerprint=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- data digests and the cache
def _old(path: Path, seconds_ago: float) -> None:
    """Date ``path`` back, out of the window in which a cache entry is not trusted."""
    when = 1_700_000_000 - seconds_ago
    os.utime(path, (when, when))


def test_one_changed_byte_changes_the_digest_and_unchanged_files_are_not_reread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    real = datahash._sha256_of
    monkeypatch.setattr(datahash, "_sha256_of", lambda path: reads.append(path.name) or real(path))
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    big, small = data / "big.bin", data / "sub" / "small.txt"
    big.write_bytes(bytes(range(256)) * 64)
    small.write_text("hello")
    _old(big, 100)
    _old(small, 100)
    first = datahash.hash_paths([data])
    assert (first.files, first.cache_hits, first.bytes_read) == (2, 0, 256 * 64 + 5)
    assert sorted(reads) == ["big.bin", "small.txt"]
    again = datahash.hash_paths([data])
    assert (again.sha256, again.cache_hits, again.bytes_read) == (first.sha256, 2, 0)  # the cache hit
    assert len(reads) == 2  # nothing was read again
    with big.open("r+b") as f:  # one byte, same size; the mtime moves as a write moves it
        f.seek(1000)
        f.write(b"\xff")
    _old(big, 50)
    changed = datahash.hash_paths([data])
    assert changed.sha256 != first.sha256
    assert (changed.cache_hits, reads[2:]) == (1, ["big.bin"])
    buckets = sorted(Path(os.environ["LIGHTNING_REPRO_CACHE"]).rglob("*.json"))
    assert buckets
    for bucket in buckets:
        bucket.write_text("{not json")  # a damaged cache is ignored: everything is read again
    assert datahash.hash_paths([data]).sha256 == changed.sha256
    assert len(reads) == 5


def _cache_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the cache files read from now on (every read of the digest cache goes through ``read_text``)."""
    cache, sizes = Path(os.environ["LIGHTNING_REPRO_CACHE"]), []
    real = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        text = real(self, *args, **kwargs)
        if cache in self.parents:
            sizes.append(len(text))
        return text

    monkeypatch.setattr(Path, "read_text", read_text)
    return sizes


def test_digesting_a_few_files_reads_a_small_part_of_a_large_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fit digests the few changed files of its checkout: the entries other runs cached (here 3000 data files)
    # must not be read whole each time (a single JSON file of every entry took 270 ms a fit at 33k entries)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3000):
        (data / f"{i}.txt").write_text(str(i))
        _old(data / f"{i}.txt", 100)
    datahash.hash_paths([data])
    cache = Path(os.environ["LIGHTNING_REPRO_CACHE"])
    total = sum(p.stat().st_size for p in cache.rglob("*.json"))
    code = tmp_path / "train.py"
    code.write_text("print(1)")
    _old(code, 100)
    sizes = _cache_reads(monkeypatch)
    assert datahash.file_digests([code]) == [datahash.hash_file(code)[0]]
    assert datahash.file_digests([code]) == [datahash.hash_file(code)[0]]  # from the cache now
    assert sizes, "the cache was not read"
    assert sum(sizes) < total / 20, (sum(sizes), total)


def test_the_cache_keeps_the_newest_entries_of_each_bucket_and_drops_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datahash, "BUCKET_ENTRIES", 2)
    legacy = Path(os.environ["LIGHTNING_REPRO_CACHE"], "file-digests.json")
    legacy.parent.mkdir(parents=True)
    legacy.write_text('{"version": 1, "files": {}}')  # an earlier version's single file
    data = tmp_path / "data"
    data.mkdir()
    for i in range(600):
        (data / f"{i}.txt").write_text(str(i))
        _old(data / f"{i}.txt", 100)
    first = datahash.hash_paths([data])
    kept = [len(json.loads(b.read_text())["files"]) for b in datahash.cache_dir().glob("*.json")]
    assert max(kept) == 2  # 600 entries over 256 buckets: some got more than 2, trimmed
    assert len(kept) <= 256
    assert not legacy.exists()
    again = datahash.hash_paths([data])
    assert again.sha256 == first.sha256
    assert again.cache_hits == sum(kept) < 600


def test_a_file_written_just_now_is_not_trusted_from_the_cache(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.txt"
    fresh.write_text("a")
    soon = time.time_ns() + 60 * 10**9  # as recent as can be, even on a machine that stalls for seconds
    os.utime(fresh, ns=(soon, soon))
    datahash.hash_paths([fresh])
    assert datahash.hash_paths([fresh]).cache_hits == 0  # could be rewritten within the mtime resolution


def test_data_section_of_a_fit(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text("1,2\n")
    _, callback = _fit(tmp_path, data_fingerprint="dvc:abc123", data_paths=[tmp_path / "train.csv"])
    assert callback.manifest is not None
    data = callback.manifest["data"]
    assert data["fingerprint"] == "dvc:abc123"
    assert (data["files"], data["paths_sha256"]) == (1, datahash.hash_paths([tmp_path / "train.csv"]).sha256)


@pytest.mark.parametrize("module", ["__main__", "notebook_cell"])
def test_a_module_class_without_a_source_file_trains_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    """A LightningModule defined in ``python -c``, a notebook cell or exec'd text has no file: ``fit`` raised
    ``OSError: source code not available`` (``__main__`` without ``__file__``) or ``TypeError`` (a module not in
    ``sys.modules``) collecting the manifest; plain Lightning trains it. The code section is the working directory's."""
    import types

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # as `python -c` or a kernel has it
    monkeypatch.chdir(tmp_path)
    inline = type("Inline", (Tiny,), {"__module__": module})
    callback = DeterminismCallback(seed=5)
    trainer = helpers.fast_trainer([callback], max_steps=2, default_root_dir=tmp_path)
    trainer.fit(inline(), _data())
    assert callback.manifest is not None
    assert callback.manifest["code"] == code_manifest(tmp_path)
    trainer.save_checkpoint(tmp_path / "inline.ckpt")
    resumed = helpers.fast_trainer([DeterminismCallback(seed=5)], max_steps=4, default_root_dir=tmp_path)
    resumed.fit(inline(), _data(), ckpt_path=tmp_path / "inline.ckpt")
    assert resumed.global_step == 4


# ---------------------------------------------------------------------------------------- code: git
def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def _new_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "test@example.com")
    _git(repo, "config", "user.name", "test")
    return repo


def test_git_state_dirty_tree_and_diff_digest(tmp_path: Path) -> None:
    repo = _new_repo(tmp_path)
    (repo / "model.py").write_text("x = 1\n")
    _git(repo, "add", "model.py")
    _git(repo, "commit", "-qm", "first")
    (repo / "lightning_logs").mkdir()
    (repo / "lightning_logs" / "metrics.csv").write_text("loss\n")
    (repo / "last.ckpt").write_bytes(b"run output")
    (repo / "trace-rank0.jsonl").write_text('{"run": {}}\n')  # our step trace with trace=True
    for log in ("wandb/run-1/files/config.yaml", "mlruns/0/meta.yaml", "outputs/2026-12-01/10-00/.hydra/config.yaml"):
        (repo / log).parent.mkdir(parents=True)  # the default folders of W&B, MLflow and Hydra
        (repo / log).write_text("run: 1\n")
    clean = code_manifest(repo / "model.py")  # what a run writes is not code
    assert clean == {"git_commit": _git(repo, "rev-parse", "HEAD"), "dirty": False, "diff_sha256": None}
    (repo / "model.py").write_text("x = 2\n")
    one = code_manifest(repo / "model.py")
    assert one["dirty"] is True
    assert one["git_commit"] == clean["git_commit"]
    (repo / "model.py").write_text("x = 3\n")
    two = code_manifest(repo)
    (repo / "notes.txt").write_text("untracked")
    three = code_manifest(repo)
    (repo / "notes.txt").write_text("untracked, edited")
    four = code_manifest(repo)
    digests = [one["diff_sha256"], two["diff_sha256"], three["diff_sha256"], four["diff_sha256"]]
    assert all(digests)
    assert len(set(digests)) == 4  # every change of the diff or of an untracked file changes the digest
    (repo / "model.py").write_text("x = 2\n")
    (repo / "notes.txt").unlink()
    assert code_manifest(repo)["diff_sha256"] == one["diff_sha256"]  # the same diff, the same digest


def test_outside_git_the_package_files_are_digested(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print(1)\n")
    before = code_manifest(tmp_path / "train.py")
    assert before["git_commit"] is None
    assert before["files"] == 1
    (tmp_path / "train.py").write_text("print(2)\n")
    assert code_manifest(tmp_path / "train.py")["files_sha256"] != before["files_sha256"]


# ---------------------------------------------------------------------------------------- written, stored, logged
def test_manifest_in_the_log_dir_in_the_entry_and_in_the_logger(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    callback = DeterminismCallback(seed=5)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts")
    trainer = helpers.fast_trainer(
        [callback, checkpoints], max_steps=2, enable_checkpointing=True, logger=CSVLogger(tmp_path / "logs")
    )
    trainer.fit(Tiny(), _data())
    log_dir = Path(trainer.log_dir or "")
    written = json.loads((log_dir / MANIFEST_FILE).read_text())  # beside Lightning's hparams.yaml
    assert written == callback.manifest
    assert written["environment"]["torch"] == str(torch.__version__)
    entry = torch.load(checkpoints.best_model_path, weights_only=True)["callbacks"][KEY]
    assert entry["manifest"] == written
    entry["manifest"]["environment"]["torch"] = "1.0.0"  # the entry's SHA-256 covers the manifest
    with pytest.raises(CorruptStateError, match="does not match its saved SHA-256"):
        Entry.from_dict(entry)
    hparams = (log_dir / "hparams.yaml").read_text()
    assert f"repro/environment/torch: {torch.__version__}" in hparams
    assert "repro/seeds/seed: 5" in hparams
    assert main(["env", "--compare", str(log_dir / MANIFEST_FILE)]) == 0  # the file is read where it is now


class _Hparams(Tiny):
    def __init__(self, lr: float = 0.1, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()


class _DataHparams(pl.LightningDataModule):
    def __init__(self, data_dir: str = "foo") -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader[Any]:
        return _data()


@pytest.mark.parametrize("datamodule", [False, True])
def test_the_users_hyperparameters_are_logged_last_as_in_plain_lightning(tmp_path: Path, datamodule: bool) -> None:
    """A logger that keeps only its last ``log_hyperparams`` call has the module's (and datamodule's) hyperparameters.

    Lightning logs them right after ``on_fit_start``; the manifest is logged in ``on_fit_start``, before them
    (Lightning's own ``models/test_hparams.py::test_adding_datamodule_hparams`` checks the last call). Both end up in
    ``hparams.yaml``.
    """
    from lightning.pytorch.loggers import CSVLogger

    calls: list[dict[str, Any]] = []

    class Recording(CSVLogger):
        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            calls.append(dict(params))
            super().log_hyperparams(params, *args, **kwargs)

    logger = Recording(tmp_path / "logs")
    trainer = helpers.fast_trainer([DeterminismCallback(seed=5)], max_steps=2, logger=logger)
    if datamodule:
        trainer.fit(_Hparams(), datamodule=_DataHparams())
    else:
        trainer.fit(_Hparams(), _data())
    expected = {"lr": 0.1, "width": 4, **({"data_dir": "foo"} if datamodule else {})}
    assert len(calls) == 2
    assert calls[-1] == expected  # Lightning's call, last
    assert all(key.startswith("repro/") for key in calls[0])  # ours, before it
    hparams = (Path(trainer.log_dir or "") / "hparams.yaml").read_text()
    assert "lr: 0.1" in hparams
    assert "repro/seeds/seed: 5" in hparams


class _SaveDirLogger(pl.loggers.Logger):
    """A logger other than TensorBoard's and CSV's: ``trainer.log_dir`` is its ``save_dir`` (maybe ``None``).

    ``as_path``: its ``save_dir`` is a ``Path``, as a user's logger may have it (Lightning's tests' ``Mock`` logger
    too): ``trainer.log_dir`` hands it on as it is.
    """

    def __init__(self, save_dir: Path | None, as_path: bool = False) -> None:
        super().__init__()
        self._save_dir = save_dir
        self._as_path = as_path

    @property
    def name(self) -> str:
        return "plain"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> Any:
        return self._save_dir if self._save_dir is None or self._as_path else str(self._save_dir)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


# name -> (logger, ModelCheckpoint dirpath or None for Lightning's default, where the manifest is: None for nowhere)
# (paths relative to tmp_path; the Trainer's default_root_dir is "root")
_PLACES: dict[str, tuple[str | None, str | None, str | None]] = {
    "csv": ("csv", "ckpts", "logs/lightning_logs/version_0"),
    "csv-default-checkpoints": ("csv", None, "logs/lightning_logs/version_0"),  # ckpts in version_0/checkpoints
    "csv-log-dir-is-the-checkpoint-dir": ("csv", "logs/lightning_logs/version_0", None),
    "save-dir-logger": ("save_dir", "ckpts", "saved"),
    "save-dir-logger-path": ("save_dir_path", "ckpts", "saved"),  # crashed: `"://" in a` of a Path
    "logger-without-save-dir": ("no_save_dir", "ckpts", "root"),
    "no-logger": (None, "ckpts", "root"),
    "no-logger-default-checkpoints": (None, None, "root"),  # ckpts in root/checkpoints
    "no-logger-checkpoints-in-the-root-dir": (None, "root", None),  # Lightning's test_..._train_time_interval
}


@pytest.mark.parametrize("case", list(_PLACES))
def test_checkpoint_dirs_hold_only_lightnings_files_and_the_manifest_is_in_the_run_dir(
    tmp_path: Path, case: str
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    logger_kind, dirpath, expected = _PLACES[case]
    expected_log_dir = "logs/lightning_logs/version_0"
    loggers: dict[str | None, Any] = {
        "csv": lambda: CSVLogger(tmp_path / "logs"),
        "save_dir": lambda: _SaveDirLogger(tmp_path / "saved"),
        "save_dir_path": lambda: _SaveDirLogger(tmp_path / "saved", as_path=True),
        "no_save_dir": lambda: _SaveDirLogger(None),
        None: lambda: False,
    }
    checkpoints = ModelCheckpoint(
        dirpath=None if dirpath is None else tmp_path / dirpath, every_n_train_steps=1, save_top_k=-1
    )
    callback = DeterminismCallback(seed=5)
    trainer = helpers.fast_trainer(
        [callback, checkpoints],
        max_steps=2,
        enable_checkpointing=True,
        logger=loggers[logger_kind](),
        default_root_dir=tmp_path / "root",
    )
    trainer.fit(Tiny(), _data())
    assert checkpoints.dirpath is not None
    listed = sorted(os.listdir(checkpoints.dirpath))
    # only what Lightning wrote: the checkpoints, and the CSVLogger's files where its log dir is the same folder
    logger_files = ["hparams.yaml", "metrics.csv"] if dirpath == expected_log_dir else []
    assert [n for n in listed if n not in logger_files] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    found = [p.parent.relative_to(tmp_path).as_posix() for p in tmp_path.rglob(MANIFEST_FILE)]
    assert found == ([] if expected is None else [expected])
    entry = torch.load(Path(checkpoints.dirpath) / listed[0], weights_only=True)["callbacks"][KEY]
    assert entry["manifest"] == callback.manifest  # in every checkpoint, wherever the file is
    if expected is not None:
        assert json.loads((tmp_path / expected / MANIFEST_FILE).read_text()) == callback.manifest


def test_no_checkpoint_callback_and_no_logger_writes_nothing(tmp_path: Path) -> None:
    _fit(tmp_path)
    assert not list(tmp_path.rglob(MANIFEST_FILE))


def test_fast_dev_run_writes_nothing(tmp_path: Path) -> None:
    # Lightning's default logger and ModelCheckpoint are there but write nothing: the smoke test of a repository's
    # root left repro_manifest.json in it
    from lightning.pytorch.loggers import CSVLogger

    options = {"default_root_dir": tmp_path, "enable_progress_bar": False, "logger": CSVLogger(tmp_path)}
    trainer = pl.Trainer(callbacks=[DeterminismCallback(seed=5)], fast_dev_run=True, **options)
    trainer.fit(Tiny(), _data())
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == []  # this file's digest cache (above)


# ---------------------------------------------------------------------------------------- drift on resume
def _drift_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if any(s in str(w.message) for s in ("changed since the", "not recorded"))]


def test_same_environment_resumes_without_a_word(tmp_path: Path, checkpoint: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, checkpoint)
    assert _drift_warnings(caught) == []


def test_doctored_torch_and_gpu_warn_naming_exactly_those_fields(tmp_path: Path, checkpoint: Path) -> None:
    doctored = _doctor(checkpoint, **{"environment.torch": "1.0.0", "hardware.gpu_names": ["NVIDIA H100"]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, callback = _fit(tmp_path, doctored)
    assert callback.restored
    (message,) = _drift_warnings(caught)
    assert [w.category for w in caught if str(w.message) == message] == [NotExactWarning]
    assert "can break bitwise continuation" in message
    current_gpus = callback.manifest["hardware"]["gpu_names"] if callback.manifest else None
    named = message.split(": ", 1)[1].split("; ")
    assert named == [
        f"environment.torch: '1.0.0' -> {str(torch.__version__)!r}",
        f"hardware.gpu_names: ['NVIDIA H100'] -> {current_gpus!r}",
    ]


def test_doctored_torch_and_gpu_raise_with_on_env_drift_error(tmp_path: Path, checkpoint: Path) -> None:
    doctored = _doctor(checkpoint, **{"environment.torch": "1.0.0", "hardware.gpu_names": ["NVIDIA H100"]})
    with pytest.raises(EnvironmentDriftError) as raised:
        _fit(tmp_path, doctored, on_env_drift="error")
    message = str(raised.value)
    assert "environment.torch: '1.0.0' -> " in message
    assert "hardware.gpu_names: ['NVIDIA H100'] -> " in message
    assert message.count(" -> ") == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_over_0_says_its_own_drift_in_its_log(rank: int, caplog: pytest.LogCaptureFixture) -> None:
    """Warnings speak on rank 0 only: the drift a rank > 0 finds (its node's CPU, its interpreter) goes to its log
    too, prefixed with its rank; rank 0's is its warning (and the resume line's reason) alone."""
    from types import SimpleNamespace

    from lightning_repro.manifest.run import RunManifest

    manifest = RunManifest(seed=1, options={}, data_fingerprint=None, data_paths=None, on_env_drift="warn")
    now = {"environment": {"torch": "2.13.0"}, "hardware": {"cpu_model": "B"}}
    manifest.value = now
    saved = SimpleNamespace(manifest={**now, "hardware": {"cpu_model": "A"}}, environment={})
    said: list[tuple[str, type[Warning]]] = []
    trainer: Any = SimpleNamespace(global_rank=rank)
    with caplog.at_level(logging.WARNING, logger="lightning_repro.manifest.run"):
        manifest.check_resumed(saved, trainer, warn=lambda message, category: said.append((message, category)))
    [(message, category)] = said
    assert "hardware.cpu_model: 'A' -> 'B'" in message
    assert category is NotExactWarning
    logged = [r.getMessage() for r in caplog.records if r.name == "lightning_repro.manifest.run"]
    assert logged == ([f"[rank: 1] {message}"] if rank else [])


def test_changed_code_data_or_packages_only_warn_even_with_error(
    tmp_path: Path, checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    doctored = _doctor(
        checkpoint,
        **{"data.fingerprint": "v0", "environment.distributions_sha256": "0" * 64, "hardware.gpu_driver": "1.0"},
    )
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="lightning_repro"):
        warnings.simplefilter("always")
        _, callback = _fit(tmp_path, doctored, on_env_drift="error")
    assert callback.restored
    (message,) = _drift_warnings(caught)
    assert message.startswith("The code or data changed since the checkpoint was written")
    assert "data.fingerprint: 'v0' -> None" in message
    assert "environment.distributions_sha256: '000" in message
    assert "gpu_driver" not in message  # the driver cannot break continuation: an INFO line only
    assert "hardware.gpu_driver: '1.0' -> None" in caplog.text


# ------------------------------------------------------------------------------------ what makes CPU numerics differ
def _other(current: str, one: str, another: str) -> str:
    return one if current != one else another


OTHER_CPU = {
    "hardware.blas_build": _other(blas_build(), "BLAS_INFO=open, LAPACK_INFO=open", "BLAS_INFO=mkl, LAPACK_INFO=mkl"),
    "hardware.cpu_capability": _other(torch.backends.cpu.get_cpu_capability(), "AVX2", "AVX512"),
    "hardware.cpu_model": _other(cpu_model(), "AMD EPYC 9654 96-Core Processor", "Intel(R) Xeon(R) Platinum 8480+"),
    "hardware.cpu_vendor": _other(cpu_vendor(), "AuthenticAMD", "GenuineIntel"),
}
"""A checkpoint from another machine: each value differs from this machine's."""


def test_env_json_and_the_fingerprint_show_what_makes_cpu_numerics_differ(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    hardware = json.loads(capsys.readouterr().out)["hardware"]
    assert hardware["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert hardware["cpu_vendor"] == cpu_vendor()
    assert hardware["cpu_model"] == cpu_model()
    assert hardware["blas_build"] == blas_build()
    assert {name: environment_fingerprint()[name] for name in CPU_FIELDS} == {n: hardware[n] for n in CPU_FIELDS}
    # build facts read from torch.__config__.show(), without what changes per run or machine
    config = torch.__config__.show()
    parts = blas_build().split(", ")
    assert parts[0].startswith("BLAS_INFO=")
    assert all(part in config or part.split(" ", 1)[1] in config for part in parts)  # "MKL 2024.2...": its version
    assert "thread" not in blas_build().lower()
    assert torch.backends.cpu.get_cpu_capability() not in blas_build()


def test_another_cpu_or_blas_build_is_drift_that_breaks_continuation(tmp_path: Path, checkpoint: Path) -> None:
    doctored = _doctor(checkpoint, **OTHER_CPU)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, callback = _fit(tmp_path, doctored)
    assert callback.restored
    (message,) = _drift_warnings(caught)
    assert [w.category for w in caught if str(w.message) == message] == [NotExactWarning]
    assert "can break bitwise continuation" in message
    hardware = callback.manifest["hardware"] if callback.manifest else {}
    assert message.split(": ", 1)[1].split("; ") == [
        f"{name}: {value!r} -> {hardware[name.split('.')[1]]!r}" for name, value in OTHER_CPU.items()
    ]
    with pytest.raises(EnvironmentDriftError, match=r"hardware\.cpu_capability: 'AVX"):
        _fit(tmp_path, doctored, on_env_drift="error")


def test_an_entry_without_manifest_compares_the_cpu_of_its_fingerprint(tmp_path: Path, checkpoint: Path) -> None:
    capability = OTHER_CPU["hardware.cpu_capability"]

    def edit(entry: dict[str, Any]) -> None:
        del entry["manifest"]  # as written before the manifest
        entry["environment"]["cpu_capability"] = capability

    current = torch.backends.cpu.get_cpu_capability()
    with pytest.raises(EnvironmentDriftError, match=f"cpu_capability: '{capability}' -> '{current}'"):
        _fit(tmp_path, _resealed(checkpoint, edit), on_env_drift="error")


@pytest.mark.parametrize("written", ["before-the-cpu-fields", "before-the-manifest"])
def test_an_entry_written_before_the_cpu_fields_says_hardware_not_recorded(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str], written: str
) -> None:
    """Not silent, and not a drift: the CPU it was written on is unknown, so nothing can be said to have changed."""

    def edit(entry: dict[str, Any]) -> None:
        for name in CPU_FIELDS:
            del entry["environment"][name]
        if written == "before-the-manifest":
            del entry["manifest"]
        else:
            for name in ("cpu_vendor", "cpu_capability", "blas_build"):  # its hardware had the CPU model already
                del entry["manifest"]["hardware"][name]

    old = _resealed(checkpoint, edit)
    missing = (
        "blas_build, cpu_capability, cpu_model, cpu_vendor"
        if written == "before-the-manifest"
        else "hardware.blas_build, hardware.cpu_capability, hardware.cpu_vendor"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, callback = _fit(tmp_path, old, on_env_drift="error")  # no drift: it does not raise
    assert callback.restored
    (message,) = _drift_warnings(caught)
    assert [w.category for w in caught if str(w.message) == message] == [ReproWarning]  # not a NotExactWarning
    assert message.startswith(
        f"Hardware not recorded: the checkpoint was written by an older lightning-repro, without {missing}."
    )
    assert main(["env", "--compare", str(old)]) == 0
    assert "Hardware not recorded" in capsys.readouterr().out
    assert main(["env", "--compare", str(old), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["not_recorded"] == missing.split(", ")
    assert report["changes"] == []


# ---------------------------------------------------------------------------------------- lightning-repro env
def test_env_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["environment"]["torch"] == str(torch.__version__)
    assert set(printed) == {"version", "code", "data", "environment", "seeds", "hardware"}


def test_env_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert all(section in out for section in ("code", "data", "environment", "seeds", "hardware"))
    assert str(torch.__version__) in out


def test_env_compare_leaves_out_the_threads_a_launcher_set_in_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a DDP run launched with OMP_NUM_THREADS unset: Lightning (or torchrun) set it and torch's threads in each rank;
    # compared from the same shell, it was "environment.env.OMP_NUM_THREADS '1' -> None (breaks)", exit 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert main(["env", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    manifest["environment"]["env"]["OMP_NUM_THREADS"] = "1"
    manifest["environment"]["num_threads"] = torch.get_num_threads() + 1
    for world, code in ((2, 0), (1, 1)):  # one process: nothing set it but the user, so it is a change
        manifest["hardware"]["world_size"] = world
        (tmp_path / f"world{world}.json").write_text(json.dumps(manifest))
        assert main(["env", "--compare", str(tmp_path / f"world{world}.json")]) == code, world
        out = capsys.readouterr().out
        said = "environment.num_threads and OMP_NUM_THREADS: a multi-process run's launcher (Lightning's, torchrun)"
        assert (said in out) == (world == 2), out
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set in the shell too: the ranks keep it, so it is compared
    manifest["hardware"]["world_size"] = 2
    (tmp_path / "set.json").write_text(json.dumps(manifest))
    assert main(["env", "--compare", str(tmp_path / "set.json"), "--json"]) == 1
    changed = {c["field"] for c in json.loads(capsys.readouterr().out)["changes"]}
    assert {"environment.env.OMP_NUM_THREADS", "environment.num_threads"} <= changed


def test_env_compare_exit_codes(tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    same = tmp_path / "same.json"
    same.write_text(json.dumps(manifest))
    assert main(["env", "--compare", str(same)]) == 0
    out = capsys.readouterr().out
    assert "No drift" in out
    assert "Not compared: data, seeds: what the run sets or chooses itself" in out
    assert "code:" not in out  # compared: this checkout is in git
    # what the run sets itself (CUBLAS_WORKSPACE_CONFIG) or chose (the package a run outside git digested): not compared
    run_set = json.loads(same.read_text())
    run_set["seeds"]["cublas_workspace_config"] = ":16:8"
    run_set["code"] = {"git_commit": None, "dirty": None, "diff_sha256": None, "files_sha256": "0" * 64, "files": 1}
    (tmp_path / "run_set.json").write_text(json.dumps(run_set))
    assert main(["env", "--compare", str(tmp_path / "run_set.json")]) == 0
    out = capsys.readouterr().out
    assert "No drift" in out
    assert "data, seeds: what the run sets or chooses itself" in out
    assert "code: the run was outside git, and its files were digested from the run's own module" in out
    manifest["environment"]["distributions_sha256"] = "0" * 64  # inputs: reported, exit 0
    manifest["seeds"]["seed"] = 123  # the run's settings: not compared by the CLI
    harmless = tmp_path / "harmless.json"
    harmless.write_text(json.dumps(manifest))
    assert main(["env", "--compare", str(harmless)]) == 0
    out = capsys.readouterr().out
    assert "environment.distributions_sha256" in out
    assert "seeds.seed" not in out
    manifest["environment"]["torch"] = "1.0.0"
    breaking = tmp_path / "breaking.json"
    breaking.write_text(json.dumps(manifest))
    assert main(["env", "--compare", str(breaking), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["breaks"] is True
    assert {c["field"]: c["kind"] for c in report["changes"]} == {
        "environment.distributions_sha256": "inputs",
        "environment.torch": "breaks",
    }
    # a checkpoint written here (another seed and flags than this process's: not compared) does not drift
    assert main(["env", "--compare", str(_doctor(checkpoint, **{"environment.torch": "1.0.0"}))]) == 1
    capsys.readouterr()
    assert main(["env", "--compare", str(checkpoint)]) == 0
    directory = tmp_path / "sharded.ckpt"  # the distributed layout: the entry in the directory's meta.pt
    directory.mkdir()
    torch.save(torch.load(checkpoint, weights_only=True), directory / "meta.pt")
    capsys.readouterr()
    assert main(["env", "--compare", str(directory)]) == 0
    assert "No drift" in capsys.readouterr().out


def test_env_compare_says_whose_code_it_compared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the code rows compare the current directory's checkout, which need not be the run's: the output says which
    assert main(["env", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    manifest["code"] = {**manifest["code"], "git_commit": "0" * 40}
    other = tmp_path / "other.json"
    other.write_text(json.dumps(manifest))
    assert main(["env", "--compare", str(other)]) == 0
    out = capsys.readouterr().out
    assert "code.git_commit" in out
    root = Path(__file__).resolve().parents[1]
    assert f"code: compared with the git checkout at {root}, the current directory's." in " ".join(out.split())
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    monkeypatch.chdir(outside)
    assert main(["env", "--compare", str(other)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"code: compared with {outside} (not in a git checkout), the current directory's." in out


def test_env_compare_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("not json")
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    (tmp_path / "list.json").write_text("[1, 2]")
    for name, reason in [
        ("missing.json", "does not exist"),
        ("notes.txt", "neither a checkpoint nor JSON"),
        ("foreign.ckpt", "holds no lightning-repro manifest"),
        ("list.json", "not a lightning-repro manifest"),
        (".", "meta.pt"),  # a directory that is no distributed checkpoint
    ]:
        assert main(["env", "--compare", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert reason in err
        assert len(err.strip().splitlines()) == 1


def test_env_compare_through_python_m(tmp_path: Path) -> None:
    saved = collect_manifest()
    saved["environment"]["cudnn"] = "1"
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(saved))
    done = subprocess.run(
        [sys.executable, "-m", "lightning_repro", "env", "--compare", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 1, done.stderr
    assert "environment.cudnn" in done.stdout


def test_the_dirty_digest_follows_the_worktree_not_the_index(tmp_path: Path) -> None:
    """Renames, deletions, a mode change, a symlink: each changes the digest; staging a change does not."""
    repo = _new_repo(tmp_path)
    for name in ("a.py", "b.py", "c.sh"):
        (repo / name).write_text(f"# {name}\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "first")
    (repo / "a.py").write_text("changed\n")
    unstaged = code_manifest(repo)["diff_sha256"]
    _git(repo, "add", "a.py")
    assert code_manifest(repo)["diff_sha256"] == unstaged  # the same code, staged or not
    digests = {unstaged}
    _git(repo, "mv", "b.py", "renamed.py")
    digests.add(code_manifest(repo)["diff_sha256"])
    (repo / "c.sh").chmod(0o755)
    digests.add(code_manifest(repo)["diff_sha256"])
    (repo / "link").symlink_to("a.py")
    digests.add(code_manifest(repo)["diff_sha256"])
    (repo / "link").unlink()
    (repo / "link").symlink_to("c.sh")
    digests.add(code_manifest(repo)["diff_sha256"])
    (repo / "c.sh").unlink()
    deleted = code_manifest(repo)
    digests.add(deleted["diff_sha256"])
    assert len(digests) == 6, digests
    assert deleted["dirty"] is True
    _git(repo, "checkout", "-q", "HEAD", "--", "c.sh")
    (repo / "c.sh").chmod(0o644)
    (repo / "link").unlink()
    _git(repo, "mv", "renamed.py", "b.py")
    assert code_manifest(repo)["diff_sha256"] == unstaged  # back to the first change alone


def test_a_large_untracked_file_enters_the_dirty_digest_by_its_size_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset downloaded into the checkout (untracked, 16 MiB or more) is data: its size counts, its content is
    not read (the first fit would read it whole). A small untracked file still counts by its content."""
    from lightning_repro.manifest import codestate

    repo = _new_repo(tmp_path)
    (repo / "model.py").write_text("x = 1\n")
    _git(repo, "add", "model.py")
    _git(repo, "commit", "-qm", "first")
    big = repo / "data" / "train.bin"
    big.parent.mkdir()
    big.write_bytes(b"\0" * codestate.UNTRACKED_BY_SIZE)
    read: list[str] = []
    real = codestate.file_digests
    monkeypatch.setattr(codestate, "file_digests", lambda files: (read.extend(map(str, files)), real(files))[1])
    first = code_manifest(repo)["diff_sha256"]
    assert first is not None
    assert str(big) not in read
    big.write_bytes(b"\1" * codestate.UNTRACKED_BY_SIZE)  # other content, the same size
    assert code_manifest(repo)["diff_sha256"] == first
    big.write_bytes(b"\1" * (codestate.UNTRACKED_BY_SIZE + 1))
    second = code_manifest(repo)["diff_sha256"]
    assert second != first
    (repo / "data" / "small.txt").write_text("a")
    third = code_manifest(repo)["diff_sha256"]
    (repo / "data" / "small.txt").write_text("b")
    assert len({second, third, code_manifest(repo)["diff_sha256"]}) == 3  # small files by their content
    _git(repo, "add", "data/train.bin")  # tracked now: a changed tracked file counts by its content, however large
    _git(repo, "commit", "-qm", "data")
    big.write_bytes(b"\2" * (codestate.UNTRACKED_BY_SIZE + 1))
    read.clear()
    code_manifest(repo)
    assert str(big) in read


def test_the_manifest_adds_no_hp_metric_row_to_tensorboard(tmp_path: Path) -> None:
    """``TensorBoardLogger.log_hyperparams`` without metrics logs a placeholder ``hp_metric=-1`` at step 0 (a row plain
    Lightning logs only for a module with hyperparameters): the manifest goes in with ``metrics={}``, into its
    ``hparams`` (``hparams.yaml``). tensorboard is not installed here: the logger's own ``log_hyperparams`` runs on
    an instance that records its ``log_metrics`` calls instead of writing events."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_repro.manifest.files import publish_manifest

    class Recording(TensorBoardLogger):
        def __init__(self) -> None:  # no SummaryWriter: what `TensorBoardLogger.__init__` sets that is used here
            self.hparams: dict[str, Any] = {}
            self._default_hp_metric = True
            self.rows: list[tuple[dict[str, Any], int | None]] = []

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            self.rows.append((metrics, step))

    control = Recording()
    with pytest.raises(Exception):  # noqa: B017, PT011 -- after its log_metrics: no tensorboard, or no SummaryWriter
        control.log_hyperparams({"lr": 0.1})  # a module's hyperparameters, as Lightning logs them
    assert control.rows == [({"hp_metric": -1}, None)]
    logger = Recording()
    trainer = SimpleNamespace(
        loggers=[logger], log_dir=str(tmp_path), default_root_dir=str(tmp_path), checkpoint_callbacks=[],
        is_global_zero=True,
    )
    path = publish_manifest(trainer, {"seed": 3, "environment": {"torch": torch.__version__}})  # type: ignore[arg-type]
    assert path == str(tmp_path / MANIFEST_FILE)
    assert logger.rows == []
    assert logger.hparams["repro/seed"] == 3
