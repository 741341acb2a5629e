"""The restore check: what a resume restored is compared with what the checkpoint saved, component by component."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import helpers
import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import (
    CorruptStateError,
    DeterminismCallback,
    NotExactWarning,
    RestoreError,
    capture_process_streams,
    restore_process_streams,
)
from lightning_repro._warn import RESUME_LOGGER
from lightning_repro.checkpoint.entry import entry_digest, seal_entry
from lightning_repro.checkpoint.verify import CHECKSUMMED, COMPONENTS, digest_value


class Full(pl.LightningModule):
    """Every component the check digests: parameters, Adam state, a scheduler, a metric state, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        self.seen = torchmetrics.SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.update(x.sum())
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)]


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)


def _fit(ckpt: Path | None = None, steps: int = 3, **callback_kwargs: Any) -> pl.Trainer:
    trainer = helpers.fast_trainer([DeterminismCallback(seed=3, **callback_kwargs)], max_steps=steps)
    trainer.fit(Full(), _data(), ckpt_path=ckpt)
    return trainer


def _saved_by(fit: Any, path: Path) -> Path:
    """``fit().save_checkpoint(path)``, the global state put back after it: a module-scoped fixture runs outside
    the autouse fixture that does so."""
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    environ, streams = dict(os.environ), capture_process_streams()
    fit().save_checkpoint(path)
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    os.environ.clear()
    os.environ.update(environ)
    restore_process_streams(streams)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_by(_fit, tmp_path_factory.mktemp("verify") / "step3.ckpt")


def _doctored(saved: Path, tmp_path: Path, edit: Any) -> Path:
    checkpoint = torch.load(saved, weights_only=True)
    edit(checkpoint)
    seal_entry(checkpoint["callbacks"]["DeterminismCallback"])  # consistent: only the restore check can tell
    path = tmp_path / "doctored.ckpt"
    torch.save(checkpoint, path)
    return path


def _part(checkpoint: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = checkpoint["callbacks"]["DeterminismCallback"]["ranks"][0]
    return part


def _bump(tensor: torch.Tensor) -> None:
    tensor.view(-1)[0] += 1


EDITS = {
    "parameters": lambda c: _bump(c["state_dict"]["net.0.weight"]),
    "optimizer": lambda c: _bump(c["optimizer_states"][0]["state"][0]["exp_avg"]),
    "lr_schedulers": lambda c: c["lr_schedulers"][0].__setitem__("last_epoch", 7),
    "data position": lambda c: _part(c)["data"][0].__setitem__("offset", _part(c)["data"][0]["offset"] + 1),
    "metric states": lambda c: _bump(_part(c)["metrics"]["seen"]["states"]["sum_value"]),
}


def test_good_resume_logs_restore_verified(saved: Path, caplog: pytest.LogCaptureFixture) -> None:
    entry = torch.load(saved, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert set(entry["ranks"][0]["restore_sha256"]) == set(COMPONENTS) - {"process streams"}  # those have their own
    with caplog.at_level(logging.INFO, logger="lightning_repro.checkpoint.verify"):
        _fit(saved, steps=4)
    assert f"restore verified: {', '.join(COMPONENTS)}" in caplog.text
    assert "[rank: 0]" in caplog.text


@pytest.mark.parametrize("component", list(EDITS))
def test_doctored_checkpoint_names_the_component(
    saved: Path, tmp_path: Path, component: str, caplog: pytest.LogCaptureFixture
) -> None:
    doctored = _doctored(saved, tmp_path, EDITS[component])
    with (
        caplog.at_level(logging.INFO, logger=RESUME_LOGGER),
        pytest.warns(NotExactWarning, match=rf"saved in: {re.escape(component)} \(SHA-256 mismatch\)"),
    ):
        _fit(doctored, steps=4)
    # the resume line says so: NOT exact, never "exact (restore check failed...)"
    line = next(r.getMessage() for r in caplog.records if "resumed from" in r.getMessage())
    assert f": NOT exact: restore check failed: {component} differs from what the checkpoint saved" in line, line
    assert ": exact" not in line


def test_on_divergence_error_raises_naming_every_component(saved: Path, tmp_path: Path) -> None:
    def both(checkpoint: dict[str, Any]) -> None:
        EDITS["parameters"](checkpoint)
        EDITS["optimizer"](checkpoint)

    with pytest.raises(RestoreError, match=r"saved in: parameters, optimizer \(SHA-256"):
        _fit(_doctored(saved, tmp_path, both), steps=4, on_divergence="error")


def test_checkpoint_without_digests_is_not_checked(
    saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def old(checkpoint: dict[str, Any]) -> None:  # as an older lightning-repro wrote it
        del _part(checkpoint)["restore_sha256"]
        EDITS["parameters"](checkpoint)

    with caplog.at_level(logging.DEBUG, logger="lightning_repro.checkpoint.verify"):
        assert _fit(_doctored(saved, tmp_path, old), steps=4).global_step == 4  # no warning (warnings are errors)
    assert "restore not verified: the checkpoint holds no restore digests" in caplog.text


def test_the_seal_covers_the_digests(saved: Path) -> None:
    entry = torch.load(saved, weights_only=True)["callbacks"]["DeterminismCallback"]
    before = entry_digest(entry)
    entry["ranks"][0]["restore_sha256"]["parameters"] = "0" * 64
    assert entry_digest(entry) != before


def test_edited_digest_without_a_new_seal_is_refused(saved: Path, tmp_path: Path) -> None:
    checkpoint = torch.load(saved, weights_only=True)
    _part(checkpoint)["restore_sha256"]["optimizer"] = "0" * 64
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    with pytest.raises(CorruptStateError, match="does not match its saved SHA-256"):
        _fit(path, steps=4)


def test_bad_on_divergence() -> None:
    with pytest.raises(ValueError, match="`on_divergence` must be 'warn' or 'error', got 'raise'"):
        DeterminismCallback(seed=1, on_divergence="raise")  # type: ignore[arg-type]


class Halve:
    """A callable object in a scheduler: state_dict() keeps its __dict__."""

    def __init__(self) -> None:
        self.factor = 0.5

    def __call__(self, epoch: int) -> float:
        return self.factor**epoch


def _schedulers() -> list[dict[str, Any]]:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    lr = torch.optim.lr_scheduler
    return [
        lr.OneCycleLR(optimizer, max_lr=1.0, total_steps=10).state_dict(),
        lr.LambdaLR(optimizer, lambda epoch: 1.0).state_dict(),
        lr.LambdaLR(optimizer, Halve()).state_dict(),
        lr.ReduceLROnPlateau(optimizer).state_dict(),
        lr.CyclicLR(optimizer, 0.1, 1.0).state_dict(),
        {"object": object()},  # an object of no known kind: its type, never its repr (which holds its address)
    ]


def test_digests_of_standard_scheduler_states_hold_no_addresses() -> None:
    first, second = _schedulers(), _schedulers()
    assert [digest_value(s) for s in first] == [digest_value(s) for s in second]
    first[2]["lr_lambdas"][0]["factor"] = 0.25
    assert digest_value(first[2]) != digest_value(second[2])
    assert digest_value({"best": float("inf")}) != digest_value({"best": float("-inf")})
    assert digest_value([1]) != digest_value([1.0]) != digest_value([True])  # type-tagged


# ---------------------------------------------------------------------------------------- large tensors: checksums
class Wide(Full):
    """:class:`Full` with a weight of 128 KiB: digested through its row checksums."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8192), nn.Dropout(0.5), nn.Linear(8192, 1))


def _fit_wide(ckpt: Path | None = None, steps: int = 3) -> pl.Trainer:
    trainer = helpers.fast_trainer([DeterminismCallback(seed=3)], max_steps=steps)
    trainer.fit(Wide(), _data(), ckpt_path=ckpt)
    return trainer


@pytest.fixture(scope="module")
def saved_wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_by(_fit_wide, tmp_path_factory.mktemp("verify-wide") / "step3.ckpt")


def test_large_tensors_are_digested_by_checksums_and_verified(
    saved_wide: Path, caplog: pytest.LogCaptureFixture
) -> None:
    digests = _part(torch.load(saved_wide, weights_only=True))["restore_sha256"]
    assert digests["parameters"].startswith(CHECKSUMMED)
    assert digests["optimizer"].startswith(CHECKSUMMED)
    assert not digests["lr_schedulers"].startswith(CHECKSUMMED)  # no large tensor: the plain SHA-256, as before
    with caplog.at_level(logging.INFO, logger="lightning_repro.checkpoint.verify"):
        _fit_wide(saved_wide, steps=4)
    assert f"restore verified: {', '.join(COMPONENTS)}" in caplog.text


@pytest.mark.parametrize("where", [0, 5000, 8191], ids=["first", "middle", "last"])
def test_one_changed_value_of_a_large_tensor_is_found(saved_wide: Path, tmp_path: Path, where: int) -> None:
    def negate(checkpoint: dict[str, Any]) -> None:  # a sign flip: one bit of one value
        weight = checkpoint["state_dict"]["net.0.weight"].view(-1)
        weight[where] = -weight[where]

    with pytest.warns(NotExactWarning, match=r"saved in: parameters \(SHA-256 mismatch\)"):
        _fit_wide(_doctored(saved_wide, tmp_path, negate), steps=4)


def test_digests_of_older_checkpoints_are_recomputed_as_written(saved_wide: Path, tmp_path: Path) -> None:
    """A checkpoint written before the checksums holds SHA-256 digests over every byte: checked that way."""

    def older(checkpoint: dict[str, Any]) -> None:
        digests = _part(checkpoint)["restore_sha256"]
        digests["parameters"] = digest_value(checkpoint["state_dict"])
        digests["optimizer"] = digest_value(checkpoint["optimizer_states"])
        assert not digests["parameters"].startswith(CHECKSUMMED)

    assert _fit_wide(_doctored(saved_wide, tmp_path, older), steps=4).global_step == 4  # no warning: verified

    def older_and_edited(checkpoint: dict[str, Any]) -> None:
        older(checkpoint)
        _bump(checkpoint["state_dict"]["net.0.weight"])

    with pytest.warns(NotExactWarning, match=r"saved in: parameters \(SHA-256 mismatch\)"):
        _fit_wide(_doctored(saved_wide, tmp_path, older_and_edited), steps=4)


def test_row_checksums_are_the_same_on_every_path() -> None:
    """``torch.mv`` (the CPU) and the chunked products (other devices) agree, overflow included; so does a tensor
    that is a view at an unaligned place of its storage (copied first)."""
    from lightning_repro.checkpoint.hashing import _weighted_rows, _weights, row_checksums

    g = torch.Generator().manual_seed(0)
    body = torch.randint(-(2**63), 2**63 - 1, (4100, 512), dtype=torch.int64, generator=g)
    weights = _weights(torch.device("cpu"))
    assert torch.equal(_weighted_rows(body, weights, matmul=True), _weighted_rows(body, weights, matmul=False))
    values = torch.randn(5 * 4096 + 7, generator=g)  # 80 KiB
    unaligned = values[1:]  # its bytes start 4 bytes into the storage: not an int64 boundary
    sums, rest = row_checksums(unaligned)
    assert torch.equal(sums, row_checksums(unaligned.clone())[0])
    assert len(rest) == (5 * 4096 + 6) * 4 % 4096
    assert digest_value(values, checksums=True) != digest_value(values)  # the two encodings never meet
