"""DeterminismCallback in process: arguments, pinning, evaluation isolation, checkpoint entry and bad checkpoints."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import (
    CheckpointReadError,
    CorruptStateError,
    DeterminismCallback,
    NotExactWarning,
    ReproError,
    ReproWarning,
    SeedMismatchError,
    capture_process_streams,
    digest_tensors,
    seeding,
)
from lightning_repro.checkpoint import state as repro_state
from lightning_repro.checkpoint.entry import seal_entry
from lightning_repro.rng import digest_process_streams


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y) + torch.rand(()) * 1e-3

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val", nn.functional.mse_loss(self.net(x), y) + torch.rand(()))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(n: int = 32) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4, shuffle=True
    )


def _trainer(callback: DeterminismCallback | None, **kwargs: Any) -> pl.Trainer:
    return helpers.fast_trainer([callback] if callback else [], **kwargs)


def _weights(model: nn.Module) -> str:
    """SHA-256 of every parameter, by name: equal digests mean the same tensors, bit for bit."""
    return digest_tensors(dict(model.named_parameters()))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seed": -3}, ValueError, r"`seed` must be in \[0, 2\*\*32 - 1\], got -3"),
        ({"seed": 2**32}, ValueError, "got 4294967296"),
        ({"seed": "42"}, TypeError, "`seed` must be an int"),
        ({"seed": 4.0}, TypeError, "`seed` must be an int"),
        (
            {"seed": 1, "deterministic": "always"},
            ValueError,
            "`deterministic` must be True, False or 'warn', got 'always'",
        ),
        ({"seed": 1, "sample_keyed": "yes"}, TypeError, "`sample_keyed` must be a bool"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        DeterminismCallback(**kwargs)


def test_construction_pins_model_init_and_sets_flags() -> None:
    DeterminismCallback(seed=3)
    first = _weights(Tiny())
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    DeterminismCallback(seed=3, deterministic="warn")
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert _weights(Tiny()) == first
    DeterminismCallback(seed=4)
    assert _weights(Tiny()) != first


@pytest.mark.parametrize("isolate", [True, False])
def test_validate_and_test_do_not_move_the_training_streams(isolate: bool) -> None:
    """``isolate_evaluation=False``: evaluation draws from the process streams (``validation_step`` draws), as
    without the callback: they move, and a second validation sees other draws."""
    callback = DeterminismCallback(seed=5, isolate_evaluation=isolate)
    model = Tiny()
    trainer = _trainer(callback)
    before = digest_process_streams(capture_process_streams())
    first = trainer.validate(model, _data(), verbose=False)
    trainer.test(model, _data(), verbose=False)
    assert (digest_process_streams(capture_process_streams()) == before) is isolate
    assert (trainer.validate(model, _data(), verbose=False) == first) is isolate  # evaluation streams are seeded


def test_a_checkpoint_evaluated_after_fit_or_in_a_fresh_trainer_gives_the_same_values(tmp_path: Path) -> None:
    """``trainer.test(ckpt_path=...)`` right after fit (the Trainer at the fit's last step) and in a new process (a
    fresh Trainer at step 0) evaluate the same weights: the same test-time draws too (they were keyed on the
    Trainer's step: another ``test_step`` draw, another reported value)."""
    first = _trainer(DeterminismCallback(seed=5), max_steps=4, limit_val_batches=0)
    first.fit(Tiny(), _data())
    first.save_checkpoint(tmp_path / "early.ckpt")
    trainer = _trainer(DeterminismCallback(seed=5), max_steps=6, limit_val_batches=0)
    trainer.fit(Tiny(), _data(), ckpt_path=tmp_path / "early.ckpt")  # this Trainer is at step 6 now
    assert trainer.global_step == 6
    early = tmp_path / "early.ckpt"
    after_fit = trainer.test(Tiny(), _data(), ckpt_path=early, verbose=False)
    fresh = _trainer(DeterminismCallback(seed=5)).test(Tiny(), _data(), ckpt_path=early, verbose=False)
    assert after_fit == fresh
    others = [  # another model's weights, no checkpoint: its Trainer's own step (0), as before
        _trainer(DeterminismCallback(seed=5)).validate(model, _data(), verbose=False) for model in (Tiny(), Tiny())
    ]
    assert others[0] != fresh  # the comparison above can fail


@pytest.mark.parametrize(
    ("trainer_flags", "undone"),
    [
        ({"deterministic": False}, "deterministic algorithms off"),
        ({"benchmark": True}, "cudnn.benchmark on"),
        # warn-only: an operation without a deterministic implementation runs where the callback's True raises
        ({"deterministic": "warn"}, "deterministic algorithms set to warn only"),
    ],
)
def test_a_trainer_that_turns_the_flags_back_is_said(trainer_flags: dict[str, Any], undone: str) -> None:
    # Lightning sets torch's flags when the Trainer is built, after the callback: the callback's promise was gone
    from lightning_repro import NondeterminismWarning

    flags = _flags()
    try:
        callback = DeterminismCallback(seed=5)
        trainer = _trainer(callback, max_steps=1, limit_val_batches=0, **trainer_flags)
        with pytest.warns(NondeterminismWarning, match=rf"turned them back \({undone}\): a Trainer built with"):
            trainer.fit(Tiny(), _data())
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[2])
        torch.backends.cudnn.benchmark = flags[1]


def test_a_trainer_s_warn_only_is_not_said_when_the_callback_chose_it() -> None:
    from lightning_repro import NondeterminismWarning

    flags = (*_flags(),)
    try:
        trainer = _trainer(DeterminismCallback(seed=5, deterministic="warn"), max_steps=1, limit_val_batches=0)
        trainer_warn = _trainer(DeterminismCallback(seed=5), max_steps=1, limit_val_batches=0, deterministic=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NondeterminismWarning)
            trainer.fit(Tiny(), _data(), [])
            trainer_warn.fit(Tiny(), _data(), [])
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[2])
        torch.backends.cudnn.benchmark = flags[1]


def _flags() -> tuple[bool, bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.benchmark,
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _fit_and_save(tmp_path: Path, seed: int = 11, steps: int = 3) -> Path:
    callback = DeterminismCallback(seed=seed)
    model = Tiny()
    trainer = _trainer(callback, max_steps=steps, limit_val_batches=0)
    trainer.fit(model, _data())
    path = tmp_path / f"seed{seed}-{steps}.ckpt"
    trainer.save_checkpoint(path)
    return path


def _resume(path: Path, seed: int = 11, **kwargs: Any) -> tuple[pl.Trainer, Tiny]:
    callback = DeterminismCallback(seed=seed)
    model = Tiny()
    trainer = _trainer(callback, max_steps=12, limit_val_batches=0, **kwargs)
    trainer.fit(model, _data(), ckpt_path=path)
    return trainer, model


def test_entry_loads_weights_only_and_is_small(tmp_path: Path) -> None:
    path = _fit_and_save(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    entry = checkpoint["callbacks"]["DeterminismCallback"]
    assert entry["version"] == 2
    assert entry["seed"] == 11
    assert entry["ranks"][0]["data"][0]["offset"] == 3
    assert entry["ranks"][0]["data"][0]["epoch"] == 0
    assert entry["topology"]["world_size"] == 1
    buffer = io.BytesIO()
    torch.save(entry, buffer)
    assert buffer.tell() <= 32 * 1024


def test_resume_in_process_matches_uninterrupted(tmp_path: Path) -> None:
    callback = DeterminismCallback(seed=11)
    model = Tiny()
    _trainer(callback, max_steps=12, limit_val_batches=0).fit(model, _data())
    trainer, resumed = _resume(_fit_and_save(tmp_path))
    assert trainer.global_step == 12
    assert _weights(resumed) == _weights(model)


def test_requires_grad_is_saved_and_given_back(tmp_path: Path) -> None:
    """The entry names the frozen parameters; a resume gives each parameter its flag back (its setup may freeze or
    unfreeze otherwise: BackboneFinetuning freezes a backbone it had unfrozen, see test_lightning_features.py)."""
    model = Tiny()
    model.net[0].requires_grad_(False)
    trainer = _trainer(DeterminismCallback(seed=11), max_steps=3, limit_val_batches=0)
    trainer.fit(model, _data())
    path = tmp_path / "frozen.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]["frozen"] == [
        "net.0.weight",
        "net.0.bias",
    ]
    resumed = Tiny()  # every parameter trainable
    _trainer(DeterminismCallback(seed=11), max_steps=4, limit_val_batches=0).fit(resumed, _data(), ckpt_path=path)
    assert [name for name, p in resumed.named_parameters() if not p.requires_grad] == ["net.0.weight", "net.0.bias"]


def test_checkpoint_without_our_entry_warns_and_trains_on(tmp_path: Path) -> None:
    model = Tiny()
    trainer = _trainer(None, max_steps=3, limit_val_batches=0)
    trainer.fit(model, _data())
    path = tmp_path / "foreign.ckpt"
    trainer.save_checkpoint(path)
    with pytest.warns(NotExactWarning, match="no lightning-repro entry"):
        trainer, _ = _resume(path)
    assert trainer.global_step == 12


def test_checkpoint_with_another_seed_raises_naming_both(tmp_path: Path) -> None:
    path = _fit_and_save(tmp_path, seed=11)
    with pytest.raises(SeedMismatchError, match="written with seed 11 but DeterminismCallback has seed 12"):
        _resume(path, seed=12)
    assert issubclass(SeedMismatchError, ReproError)


def _r0(entry: dict[str, Any]) -> Any:
    """Rank 0's part of an entry (version 2)."""
    return entry["ranks"][0]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda e: _r0(e)["streams"]["torch"].__setitem__(0, (int(_r0(e)["streams"]["torch"][0]) + 1) % 256),
            "do not match their saved SHA-256",
        ),
        (lambda e: _r0(e)["streams"].pop("python"), "'python' stream is missing"),
        (lambda e: _r0(e).pop("data"), "'data' is missing"),
        (lambda e: _r0(e)["data"][0].__setitem__("offset", -1), "bad data position"),
        (lambda e: e.__setitem__("seed", "eleven"), "'seed' is a str"),
        (lambda e: _r0(e).__setitem__("logged", {"k": {"value": 1}}), "logged value 'k'"),
    ],
    ids=["flipped-byte", "missing-stream", "missing-data", "bad-offset", "bad-seed", "bad-logged"],
)
def test_damaged_entry_raises_and_restores_nothing(tmp_path: Path, damage: Any, message: str) -> None:
    path = _fit_and_save(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    entry = checkpoint["callbacks"]["DeterminismCallback"]
    damage(entry)
    seal_entry(entry)  # a consistent SHA-256, so the check of the damaged part itself is reached
    bad = tmp_path / "bad.ckpt"
    torch.save(checkpoint, bad)
    callback = DeterminismCallback(seed=11)
    model = Tiny()
    before = digest_process_streams(capture_process_streams())
    weights = digest_tensors(model.state_dict())
    with pytest.raises(CorruptStateError, match=message) as error:
        _trainer(callback, max_steps=12, limit_val_batches=0).fit(model, _data(), ckpt_path=bad)
    assert digest_process_streams(capture_process_streams()) == before  # nothing restored half-way
    assert digest_tensors(model.state_dict()) == weights  # refused before Lightning loaded the weights
    assert callback._pending is None
    assert "earlier checkpoint" in str(error.value)
    assert "ignore_checkpoint_state=True" in str(error.value)


def _edit(path: Path, target: Path, edit: Any) -> Path:
    checkpoint = torch.load(path, weights_only=True)
    edit(checkpoint["callbacks"]["DeterminismCallback"])
    torch.save(checkpoint, target)
    return target


@pytest.mark.parametrize(
    "edit",
    [
        lambda e: _r0(e)["data"][0].__setitem__("offset", _r0(e)["data"][0]["offset"] + 1),
        lambda e: _r0(e).__setitem__("batches", _r0(e)["batches"] - 1),
        lambda e: e["topology"]["num_workers"].__setitem__(0, 2),
        lambda e: _r0(e)["streams"]["torch"].__setitem__(-1, (int(_r0(e)["streams"]["torch"][-1]) + 1) % 256),
        lambda e: e["environment"].__setitem__("torch", "1.0.0"),
        lambda e: e.__setitem__("entry_sha256", "0" * 64),
    ],
    ids=["data-offset", "batches", "topology", "stream-byte", "environment", "digest"],
)
def test_any_edit_of_the_entry_is_refused(tmp_path: Path, edit: Any) -> None:
    bad = _edit(_fit_and_save(tmp_path), tmp_path / "edited.ckpt", edit)
    with pytest.raises(CorruptStateError, match="does not match its saved SHA-256"):
        _resume(bad)


def test_an_entry_whose_seal_was_taken_off_is_refused(tmp_path: Path) -> None:
    # every version-2 entry is written sealed: without its seal, an edit of the rest would pass unseen
    def unseal_and_edit(entry: dict[str, Any]) -> None:
        del entry["entry_sha256"]
        _r0(entry)["batches"] -= 1

    bad = _edit(_fit_and_save(tmp_path), tmp_path / "unsealed.ckpt", unseal_and_edit)
    with pytest.raises(CorruptStateError, match=r"it has no seal \(entry_sha256\)"):
        _resume(bad)


class Counting(Tiny):
    """Tiny with a torchmetrics state logged as an epoch aggregate."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.positives = torchmetrics.SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, y = batch
        self.positives.update((y > 0).sum().float())
        self.log("positives", self.positives, on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def _fit_counting(ckpt: Path | None = None, save: Path | None = None, **kwargs: Any) -> tuple[pl.Trainer, Counting]:
    callback = DeterminismCallback(seed=13, **kwargs)
    model = Counting()
    trainer = _trainer(callback, max_steps=3 if save else 8, limit_val_batches=0)
    trainer.fit(model, _data(), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer, model


def test_edited_metric_state_is_refused(tmp_path: Path) -> None:
    """`tp += 1` on a saved metric state used to be accepted and changed the logged epoch value."""
    path = tmp_path / "metric.ckpt"
    _fit_counting(save=path)
    metric = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"][0]["metrics"]["positives"]
    assert set(metric["states"]) == {"sum_value"}

    def tamper(entry: dict[str, Any]) -> None:
        entry["ranks"][0]["metrics"]["positives"]["states"]["sum_value"] += 1

    bad = _edit(path, tmp_path / "tampered.ckpt", tamper)
    with pytest.raises(CorruptStateError, match=r"does not match its saved SHA-256.*earlier checkpoint"):
        _fit_counting(ckpt=bad)
    # the documented way on: load the checkpoint, ignore our entry, and say loudly that it is not exact
    with pytest.warns(NotExactWarning, match=r"ignore_checkpoint_state=True.*NOT checked or restored"):
        trainer, _ = _fit_counting(ckpt=bad, ignore_checkpoint_state=True)
    assert trainer.global_step == 8
    untampered, _ = _fit_counting()
    resumed, _ = _fit_counting(ckpt=path)
    assert torch.equal(resumed.callback_metrics["positives"], untampered.callback_metrics["positives"])


@pytest.mark.parametrize("seed", [11, 12], ids=["corrupt", "other-seed"])
def test_refused_entry_leaves_the_model_and_environment_untouched(tmp_path: Path, seed: int) -> None:
    path = _fit_and_save(tmp_path)
    bad = path
    if seed == 11:
        bad = _edit(path, tmp_path / "bad.ckpt", lambda e: _r0(e)["data"][0].__setitem__("offset", 0))
    callback = DeterminismCallback(seed=seed)
    model = Tiny()
    weights = digest_tensors(model.state_dict())
    environ = dict(os.environ)
    trainer = _trainer(callback, max_steps=12, limit_val_batches=0)
    with pytest.raises((CorruptStateError, SeedMismatchError)):
        trainer.fit(model, _data(), ckpt_path=bad)
    assert digest_tensors(model.state_dict()) == weights
    assert dict(os.environ) == environ  # what the run exported is taken back when it raises too
    assert "load_checkpoint" not in vars(trainer.strategy)  # and its wrappers are undone


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "older-entry-without-digest"])
def test_entry_is_parsed_once_when_the_file_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sealed: bool
) -> None:
    path = _fit_and_save(tmp_path)
    if not sealed:  # a version-1 entry written before entries were sealed: still loads
        path = helpers.as_v1_checkpoint(path, tmp_path / "v1.ckpt")
        path = _edit(path, tmp_path / "older.ckpt", lambda e: e.pop("entry_sha256"))
    calls = []
    parse = repro_state.parse_entry

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["seed"])
        return parse(*args, **kwargs)

    monkeypatch.setattr(repro_state, "parse_entry", counting)
    if sealed:
        trainer, _ = _resume(path)
    else:  # an entry of version 1 records no CPU fields: said once, as a resume from it says
        with pytest.warns(ReproWarning, match="Hardware not recorded"):
            trainer, _ = _resume(path)
    assert calls == [11]
    assert trainer.callbacks[0].restored  # type: ignore[attr-defined]


@pytest.mark.parametrize("cut", ["truncated", "garbage"])
def test_unreadable_checkpoint_file_gets_one_clear_error(tmp_path: Path, cut: str) -> None:
    path = _fit_and_save(tmp_path)
    data = path.read_bytes()
    bad = tmp_path / f"{cut}.ckpt"
    bad.write_bytes(data[: len(data) // 2] if cut == "truncated" else b"not a checkpoint" * 100)
    model = Tiny()
    weights = digest_tensors(model.state_dict())
    with pytest.raises(CheckpointReadError, match=re.escape(f"cannot read the checkpoint file '{bad}'")) as error:
        _trainer(DeterminismCallback(seed=11), max_steps=12, limit_val_batches=0).fit(model, _data(), ckpt_path=bad)
    assert error.value.__cause__ is not None  # chained from torch's own error
    assert issubclass(CheckpointReadError, ReproError)
    assert digest_tensors(model.state_dict()) == weights


class EnvironmentProbe(Tiny):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen = os.environ.get("PYTHONHASHSEED")
        return super().training_step(batch, batch_idx)


def test_os_environ_is_as_it_was_after_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only CUBLAS_WORKSPACE_CONFIG (which torch needs in this process) outlives the run."""
    for name in ("PYTHONHASHSEED", "PL_GLOBAL_SEED", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(seeding, "_INTERPRETER_HASH_SEED", None)  # as if Python started without it
    before = dict(os.environ)
    callback = DeterminismCallback(seed=17)
    model = EnvironmentProbe()
    _trainer(callback, max_steps=2, limit_val_batches=0).fit(model, _data())
    assert model.seen == "17"  # exported while the run can start workers by exec
    after = dict(os.environ)
    assert after.pop("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    assert after == before
    probe = "import os, sys; print(os.environ.get('PYTHONHASHSEED'), sys.flags.hash_randomization)"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert child.stdout.split() == ["None", "1"]  # a later, unrelated process hashes at random again


def test_fingerprint_records_the_interpreters_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_repro import environment_fingerprint

    monkeypatch.setattr(seeding, "_INTERPRETER_HASH_SEED", None)
    monkeypatch.setenv("PYTHONHASHSEED", "5")  # exported for children: not what this interpreter hashes with
    assert environment_fingerprint()["env:PYTHONHASHSEED"] == ""
    monkeypatch.setattr(seeding, "_INTERPRETER_HASH_SEED", "0")
    assert environment_fingerprint()["env:PYTHONHASHSEED"] == "0"


def test_newer_entry_version_is_refused(tmp_path: Path) -> None:
    path = _fit_and_save(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"]["DeterminismCallback"]["version"] = 99
    torch.save(checkpoint, tmp_path / "new.ckpt")
    with pytest.raises(ReproError, match="version 99"):
        _resume(tmp_path / "new.ckpt")


def test_lightning_cli_yaml(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (the `cli` and `test` extras)")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_repro.DeterminismCallback\n"
        "      init_args:\n"
        "        seed: 77\n"
        "        deterministic: warn\n"
        "        sample_keyed: true\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LightningCLI's own notes about the environment
        cli = LightningCLI(Tiny, run=False, args=["--config", str(config)], save_config_callback=None)
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, DeterminismCallback)]  # type: ignore[attr-defined]
    assert len(callbacks) == 1
    assert callbacks[0].seed == 77
    assert callbacks[0].deterministic == "warn"


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A sized stream whose position is its state; every item draws augmentation from the process streams."""

    def __init__(self) -> None:
        self.position = 0

    def __len__(self) -> int:
        return 64

    def __iter__(self) -> Any:
        while self.position < 64:
            i = self.position
            self.position += 1
            base = torch.randn(4, generator=torch.Generator().manual_seed(i))
            x = base + 0.1 * torch.rand(4)
            yield x, base.sum(0, keepdim=True)
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def _stream_fit(max_steps: int, ckpt: Path | None = None, save: Path | None = None) -> Tiny:
    callback = DeterminismCallback(seed=21)
    model = Tiny()
    trainer = _trainer(callback, max_steps=max_steps, limit_val_batches=0, max_epochs=3)
    trainer.fit(model, DataLoader(Stream(), batch_size=4), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return model


# torch's advice about sized IterableDatasets under several workers; this one is read in the main process
@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")
def test_stateful_iterable_dataset_resumes_exactly(tmp_path: Path) -> None:
    uninterrupted = _stream_fit(30)
    path = tmp_path / "stream.ckpt"
    _stream_fit(6, save=path)
    part = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]["ranks"][0]
    assert part["iterables"] == {}  # the main process's state is no longer saved: the worker's, with its position
    [worker] = part["streaming"]["0"]["workers"]
    assert worker == {"worker": 0, "items": 24, "batches": 6, "state": {"position": 24}}
    resumed = _stream_fit(30, ckpt=path)
    assert _weights(resumed) == _weights(uninterrupted)


def test_environment_drift_is_reported_on_resume(tmp_path: Path) -> None:
    path = _fit_and_save(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"]["DeterminismCallback"]["environment"]["torch"] = "1.0.0"
    del checkpoint["callbacks"]["DeterminismCallback"]["manifest"]  # as written before the manifest
    seal_entry(checkpoint["callbacks"]["DeterminismCallback"])
    torch.save(checkpoint, tmp_path / "drift.ckpt")
    with pytest.warns(NotExactWarning, match=r"environment changed .* torch: '1.0.0' -> '2"):
        _resume(tmp_path / "drift.ckpt")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", NotExactWarning)
        _resume(path)  # the same environment: no warning


# ------------------------------------------------------------------ the batch hooks Lightning may skip
def test_lightning_skips_the_batch_hooks_we_leave_out_and_calls_a_subclass_s_own() -> None:
    """No-op batch hooks cost ~1.2 us a call in Lightning's dispatch: ours are None, a subclass's run as usual."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.profilers import SimpleProfiler

    from lightning_repro._lightning.hooks import BATCH_HOOKS

    calls: list[str] = []

    class Sub(DeterminismCallback):
        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            calls.append("sub")
            super().on_before_backward(trainer, pl_module, loss)  # the no-op is still there for super()

    plain, sub = DeterminismCallback(3), Sub(4)
    assert all(getattr(plain, name) is None for name in BATCH_HOOKS)
    assert callable(sub.on_before_backward)
    profiler = SimpleProfiler()
    for callback in (plain, sub):
        trainer = pl.Trainer(
            callbacks=[callback], max_steps=3, logger=False, enable_progress_bar=False, enable_checkpointing=False,
            enable_model_summary=False, profiler=profiler if callback is plain else None,
        )
        trainer.fit(BoringModel())
    actions = set(profiler.recorded_durations)
    assert "[Callback]DeterminismCallback.on_train_batch_start" in actions  # the profiler sees our hooks
    assert not [a for a in actions if a.startswith("[Callback]DeterminismCallback.on_before")], sorted(actions)
    assert calls == ["sub"] * 3


def test_the_train_batch_hooks_run_only_while_they_have_work() -> None:
    """Without a trace: ``on_train_batch_start`` once per fit (a resume's first batch), ``_end`` never; a
    subclass's own hooks run at every step."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.profilers import SimpleProfiler

    seen: list[str] = []

    class Sub(DeterminismCallback):
        def on_train_batch_end(self, *args: Any) -> None:
            seen.append("end")
            super().on_train_batch_end(*args)

    profiler = SimpleProfiler()
    ours, sub = DeterminismCallback(3), Sub(4)
    for callback in (ours, ours, sub):  # the same callback fits twice: its hook runs again at the first batch
        trainer = pl.Trainer(
            callbacks=[callback], max_steps=4, logger=False, enable_progress_bar=False, enable_checkpointing=False,
            enable_model_summary=False, profiler=profiler if callback is ours else None,
        )
        trainer.fit(BoringModel())
    calls = profiler.recorded_durations
    assert len(calls["[Callback]DeterminismCallback.on_train_batch_start"]) == 2
    assert "[Callback]DeterminismCallback.on_train_batch_end" not in calls
    assert seen == ["end"] * 4


def test_the_callback_and_a_trainer_holding_it_copy_and_pickle(tmp_path: Path) -> None:
    """``copy.deepcopy(trainer)``-style copies and ``torch.save(model)`` (the module refers to its trainer, which holds
    the callbacks) must work as without the callback: Lightning's own tests do both. The warning cache is a set
    subclass: a copy passes its items to its constructor."""
    import copy
    import pickle

    repro = DeterminismCallback(seed=3)
    repro._warnings.add("a warned message")
    trainer = helpers.fast_trainer([repro], max_epochs=1, default_root_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)), batch_size=4)
    module = Tiny()
    trainer.fit(module, data)
    for copied in (copy.deepcopy(repro), pickle.loads(pickle.dumps(repro))):
        assert "a warned message" in copied._warnings
        assert copied.seed == 3
    torch.save(module, tmp_path / "module.pt")  # pickles the trainer and its callbacks with it
