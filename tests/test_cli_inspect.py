"""``lightning-repro inspect CKPT``: what a checkpoint's entry holds, whether it is whole, and its exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helpers
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_repro import DeterminismCallback
from lightning_repro.checkpoint.entry import seal_entry
from lightning_repro.cli.main import main


class EpochScaled(helpers.SmallRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def on_train_epoch_start(self) -> None:
        self.scale = 1.0 + self.current_epoch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Written in the middle of epoch 1 (after batch 2 of 8), accumulating 2 batches a step."""
    root = tmp_path_factory.mktemp("inspect")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    callbacks = [DeterminismCallback(seed=11), helpers.SaveAt(root / "mid.ckpt", (1, 2))]
    trainer = helpers.fast_trainer(callbacks, max_epochs=2, accumulate_grad_batches=2, default_root_dir=root)
    trainer.fit(EpochScaled(), DataLoader(data, batch_size=8, shuffle=True))
    return root / "mid.ckpt"


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_summary_says_where_and_what(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = torch.load(checkpoint, weights_only=True)
    code, out, _ = _run(capsys, str(checkpoint))
    assert code == 0
    assert f"epoch 1, global step {saved['global_step']}" in out
    assert "sealed, every part checks" in out
    assert "(the entry only: the weights, optimizer and scheduler states are checked against it by the resume)" in out
    assert "seed 11; world size 1" in out
    assert "loader 0: epoch 1, pass 0, 3 of 8 batches read" in out
    assert "accumulate_grad_batches 2" in out
    assert "set by the epoch-start hooks: module.scale = 2.0" in out
    assert "gradients carried into the next batch: 4 tensor(s)" in out  # batch 2 of a 2-batch window: mid-window


def test_json_holds_the_same(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = torch.load(checkpoint, weights_only=True)
    code, out, _ = _run(capsys, str(checkpoint), "--json")
    assert code == 0
    report = json.loads(out)
    # the keys a damaged entry's object has (it had no "whole" nor "checkpoint": scripts read "whole")
    assert (report["whole"], report["checkpoint"]) == (True, str(checkpoint))
    assert report["state_key"] == "DeterminismCallback"
    assert (report["epoch"], report["global_step"], report["seed"]) == (1, saved["global_step"], 11)
    [rank] = report["ranks"]
    entry = saved["callbacks"]["DeterminismCallback"]
    assert rank["process_streams_sha256"] == entry["ranks"][0]["streams_sha256"]
    assert rank["restore_check"] == sorted(k for k in entry["ranks"][0]["restore_sha256"] if not k.startswith("attr"))
    assert rank["epoch_start_attributes"] == {"module.scale": "2.0"}
    assert report["drift_from_here"] == {"breaks": False, "changes": [], "not_recorded": []}  # written here


def test_the_drift_from_this_environment_is_said(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, str(checkpoint))
    assert "drift from this environment: none in what it records" in out
    saved: dict[str, Any] = torch.load(checkpoint, weights_only=True)
    entry = saved["callbacks"]["DeterminismCallback"]
    entry["manifest"]["environment"]["torch"] = "1.0.0"
    seal_entry(entry)
    other = tmp_path / "other-torch.ckpt"
    torch.save(saved, other)
    code, out, _ = _run(capsys, str(other))
    assert code == 0  # whole: the drift is said, as `env --compare` says it (exit 1 there)
    assert "drift from this environment: environment.torch (breaks): can break bitwise continuation" in out


def test_a_distributed_checkpoint_directory_is_read_through_its_metadata(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "sharded.ckpt"
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(3)}, checkpoint_id=directory, no_dist=True)  # .metadata and a tensor file
    torch.save(torch.load(checkpoint, weights_only=True), directory / "meta.pt")
    code, out, _ = _run(capsys, str(directory))
    assert code == 0
    assert "seed 11" in out
    (directory / ".metadata").unlink()  # the tensors' index: the directory cannot be loaded (test_sharded.py: more)
    code, out, _ = _run(capsys, str(directory))
    assert code == 1
    assert "damaged: its .metadata (the index of its tensor files) is missing" in out


def test_a_damaged_entry_exits_1_and_says_what(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved: dict[str, Any] = torch.load(checkpoint, weights_only=True)
    saved["callbacks"]["DeterminismCallback"]["ranks"][0]["batches"] = 5  # not what the seal was taken over
    damaged = tmp_path / "damaged.ckpt"
    torch.save(saved, damaged)
    code, out, _ = _run(capsys, str(damaged))
    assert code == 1
    assert "damaged" in out
    code, out, _ = _run(capsys, str(damaged), "--json")  # one JSON object (it was the text line)
    assert code == 1
    report = json.loads(out)
    assert report["whole"] is False
    assert "damaged" in report["problem"]
    assert report["checkpoint"] == str(damaged)


def test_a_truncated_checkpoint_is_damaged_not_bad_input(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file torch.save began to write, cut short (an interrupted copy): exit 1, damaged, as a resume says (it was
    exit 2, "not a file torch.save wrote"); with --json one JSON object; ``env --compare`` names it too."""
    half = tmp_path / "half.ckpt"
    half.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    code, out, _ = _run(capsys, str(half))
    assert code == 1
    assert out.startswith(f"'{half}' is damaged: it begins as a file torch.save wrote but its end is missing"), out
    code, out, _ = _run(capsys, str(half), "--json")
    assert code == 1
    assert json.loads(out)["whole"] is False
    assert main(["env", "--compare", str(half)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "is damaged: it begins as a file torch.save wrote" in err


def test_bad_input_exits_2_with_one_line(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain.ckpt"
    torch.save({"epoch": 0, "global_step": 1, "callbacks": {}}, plain)
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    weights = tmp_path / "weights.ckpt"  # as ModelCheckpoint(save_weights_only=True) writes it: no callback states
    full = torch.load(checkpoint, weights_only=True)
    torch.save({k: v for k, v in full.items() if k not in ("callbacks", "optimizer_states", "lr_schedulers")}, weights)
    for path, says in [
        (plain, "holds no lightning-repro entry (written without DeterminismCallback?)"),
        (weights, "holds the weights only (ModelCheckpoint(save_weights_only=True)): no callback states"),
        (text, "is not a checkpoint"),
        (tmp_path / "missing.ckpt", "does not exist"),
        (tmp_path, "meta.pt"),
    ]:
        code, _, err = _run(capsys, str(path))
        assert code == 2, path
        assert says in err
        assert len(err.strip().splitlines()) == 1


def test_a_version_1_entry_is_read(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = helpers.as_v1_checkpoint(checkpoint, tmp_path / "v1.ckpt")
    code, out, _ = _run(capsys, str(old), "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["entry_version"], report["seed"], report["manifest"]) == (1, 11, None)
    assert report["ranks"][0]["restore_check"] == []  # version 1 wrote no restore digests
    code, out, _ = _run(capsys, str(old))
    assert code == 0
    assert "restore check compares: nothing (written without the restore digests)" in out


class EmaHook(helpers.SmallRegressor):
    """A module with its own ``on_train_batch_end``: a batch-end file records what the rest of that hook gets."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        return iter([(torch.randn(4, generator=g), torch.randn(1, generator=g)) for _ in range(16)])


@pytest.mark.parametrize(("streamed", "said"), [(False, "the batch loaded again"), (True, "the batch kept")])
def test_what_the_rest_of_a_batch_end_hook_gets_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], streamed: bool, said: str
) -> None:
    g = torch.Generator().manual_seed(0)
    data = Stream() if streamed else TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    callbacks = [DeterminismCallback(seed=11), helpers.SaveAt(tmp_path / "batch-end.ckpt", (0, 2))]
    trainer = helpers.fast_trainer(callbacks, max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(EmaHook(), DataLoader(data, batch_size=4))
    code, out, _ = _run(capsys, str(tmp_path / "batch-end.ckpt"))
    assert code == 0
    assert f"  for the rest of on_train_batch_end: outputs, {said}\n" in out
    code, out, _ = _run(capsys, "--json", str(tmp_path / "batch-end.ckpt"))
    assert json.loads(out)["ranks"][0]["batch_end"] == f"outputs, {said}"


class TwoLoaders(helpers.SmallRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return sum(nn.functional.mse_loss(self.net(x), y) for x, y in batch)  # type: ignore[return-value]


def test_which_cycled_loaders_ran_out_is_said_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two train loaders in Lightning's ``max_size_cycle`` (4 and 2 batches): saved at batch 2, after the short one
    ran out and was cycled, the part holds the mask and the summary names loader 1; at batch 0, none yet."""
    g = torch.Generator().manual_seed(0)
    loaders = [
        DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)
        for n in (16, 8)
    ]
    callbacks = [
        DeterminismCallback(seed=11),
        helpers.SaveAt(tmp_path / "ran-out.ckpt", (0, 2)),
        helpers.SaveAt(tmp_path / "first.ckpt", (0, 0)),
    ]
    trainer = helpers.fast_trainer(callbacks, max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(TwoLoaders(), loaders)
    for name, said, mask in (("ran-out", "1", [1]), ("first", "none yet", [])):
        code, out, _ = _run(capsys, str(tmp_path / f"{name}.ckpt"))
        assert code == 0
        assert f"  cycled train loaders that ran out in the epoch: {said}\n" in out, out
        code, out, _ = _run(capsys, "--json", str(tmp_path / f"{name}.ckpt"))
        assert json.loads(out)["ranks"][0]["loaders_run_out"] == mask


def test_one_loader_says_nothing_of_loaders_run_out(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--json", str(checkpoint))
    assert code == 0
    assert json.loads(out)["ranks"][0]["loaders_run_out"] is None  # Lightning's combined loader of one: no mask


def test_a_ranks_own_logged_values_are_named(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A two-rank entry (as DDP writes it): rank 1's part holds its trainer metrics and log row; those unlike rank
    0's (the entry's shared values) are named, bit for bit (a NaN equals itself); none for rank 0."""
    saved = torch.load(checkpoint, weights_only=True)
    entry = saved["callbacks"]["DeterminismCallback"]
    entry["ranks"].append(dict(entry["ranks"][0]))
    entry["topology"] = {**entry["topology"], "world_size": 2}
    nan = torch.tensor(float("nan"))
    entry["callback_metrics"]["_callback_metrics"] = {"loss": torch.tensor(0.5), "acc": torch.tensor(0.75), "n": nan}
    entry["pending"] = {"log": {"loss_step": torch.tensor(0.5)}, "validate": False}
    entry["ranks"][1]["callback_metrics"] = {
        "_callback_metrics": {"loss": torch.tensor(0.25), "acc": torch.tensor(0.75)}
    }
    entry["ranks"][1]["callback_metrics"]["_callback_metrics"]["n"] = torch.tensor(float("nan"))
    entry["ranks"][1]["pending_log"] = {"loss_step": torch.tensor(0.25)}
    seal_entry(entry)
    torch.save(saved, tmp_path / "two.ckpt")
    code, out, _ = _run(capsys, str(tmp_path / "two.ckpt"), "--json")
    assert code == 0
    assert [rank["own_logged_values"] for rank in json.loads(out)["ranks"]] == [[], ["loss", "loss_step"]]
    code, out, _ = _run(capsys, str(tmp_path / "two.ckpt"))
    assert code == 0
    assert "  own logged values (unlike rank 0's): loss, loss_step\n" in out
    assert out.count("own logged values") == 1


def test_a_missing_checkpoint_is_not_called_damaged(tmp_path: Path) -> None:
    # ModelParallelStrategy's load_checkpoint says a missing path with a ValueError: no "truncated or damaged" added
    from lightning_repro.checkpoint.reading import read_checkpoint
    from lightning_repro.exceptions import CheckpointReadError

    def sharded_load(path: Any) -> Any:
        raise ValueError(f"The path {str(path)!r} does not point to a valid checkpoint.")

    with pytest.raises(ValueError, match="does not point to a valid checkpoint") as raised:
        read_checkpoint(sharded_load, tmp_path / "typo.ckpt")
    assert not isinstance(raised.value, CheckpointReadError)
    (tmp_path / "there.ckpt").write_bytes(b"PK\x03\x04 cut")  # a file that is there: damaged, said so
    with pytest.raises(CheckpointReadError, match="A truncated or damaged file"):
        read_checkpoint(sharded_load, tmp_path / "there.ckpt")
