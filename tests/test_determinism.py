"""End-to-end: one seed pins the whole run, whatever the workers and the validation settings.

Each run is a fresh process (tests/scenario.py): a dataset whose ``__getitem__`` draws from
torch, numpy and python ``random``, dropout, a shuffled sampler, ``torch.rand`` inside
``training_step``, AdamW with a per-step scheduler, torchmetrics. Runs are compared by the
SHA-256 of every parameter and optimizer tensor.
"""

from __future__ import annotations

from typing import Any

import pytest
import runner

pytestmark = pytest.mark.slow

BASE: dict[str, Any] = {"max_epochs": 2}


# 2 workers, not persistent: test_user_worker_init_fn_still_runs (the same run, with a worker_init_fn of the user's)
@pytest.mark.parametrize(
    ("num_workers", "persistent"),
    [(1, False), (3, False), (2, True)],  # 3 workers split 12 batches unevenly
)
def test_final_weights_do_not_depend_on_workers(runs: Any, num_workers: int, persistent: bool) -> None:
    reference, ref_out = runs.reference({**BASE, "num_workers": 0})
    result, out = runs.run({**BASE, "num_workers": num_workers, "persistent_workers": persistent}, "workers")
    assert result["params"] == reference["params"]
    assert result["optimizer"] == reference["optimizer"]
    assert [s["indices"] for s in runner.steps(out)] == [s["indices"] for s in runner.steps(ref_out)]


def test_plain_lightning_workers(runs: Any) -> None:
    """The control: without the callback the weights change with workers (so the test above can fail).

    Asserts the correct behaviour and is reported as xfailed while plain Lightning does not have it.
    """
    plain0, _ = runs.reference({**BASE, "repro": False, "num_workers": 0})
    plain2, _ = runs.run({**BASE, "repro": False, "num_workers": 2}, "plain-workers")
    with runner.plain_lightning_bug("the weights depend on num_workers (workers seeded per worker, not per sample)"):
        assert plain2["params"] == plain0["params"], "weights differ between 0 and 2 workers"


@pytest.mark.parametrize(
    "validation",
    [
        {"val": "off"},
        {"val": 5},  # every 5 batches, inside the epoch
        {"val": "epoch", "val_workers": 2},
        {"val": 3, "val_workers": 2},
    ],
    ids=["off", "every-5-batches", "epoch-end-2-workers", "every-3-batches-2-workers"],
)
def test_trajectory_does_not_depend_on_validation(runs: Any, validation: dict[str, Any]) -> None:
    reference, ref_out = runs.reference({**BASE, "num_workers": 0})  # validation at epoch end, 0 workers
    result, out = runs.run({**BASE, "num_workers": 0, **validation}, "validation")
    assert result["params"] == reference["params"]
    ref_steps, steps = runner.steps(ref_out), runner.steps(out)
    assert [(s["indices"], s["loss"]) for s in steps] == [(s["indices"], s["loss"]) for s in ref_steps]


def test_plain_lightning_validation(runs: Any) -> None:
    """The control: without the callback validation moves the training streams (reported as xfailed)."""
    plain, _ = runs.reference({**BASE, "repro": False, "num_workers": 0})
    plain_off, _ = runs.run({**BASE, "repro": False, "num_workers": 0, "val": "off"}, "plain-val-off")
    with runner.plain_lightning_bug("validation draws from the training RNG streams"):
        assert plain_off["params"] == plain["params"], "weights differ with validation on and off"


def test_same_seed_same_run_other_seed_other_run(runs: Any) -> None:
    first, first_out = runs.reference({**BASE, "num_workers": 0})
    again, again_out = runs.run({**BASE, "num_workers": 0}, "again")
    other, other_out = runs.run({**BASE, "num_workers": 0, "seed": 4321}, "other-seed")
    assert again["params"] == first["params"]
    assert runner.steps(again_out) == runner.steps(first_out)
    assert other["params"] != first["params"]
    assert [s["indices"] for s in runner.steps(other_out)] != [s["indices"] for s in runner.steps(first_out)]


def test_user_worker_init_fn_still_runs(runs: Any, tmp_path: Any) -> None:
    """Also the 2-worker case of test_final_weights_do_not_depend_on_workers: the user's function runs first."""
    marker = tmp_path / "markers"
    marker.mkdir()
    reference, ref_out = runs.reference({**BASE, "num_workers": 0})
    result, out = runs.run(
        {**BASE, "num_workers": 2, "user_worker_init": True},
        "user-init",
        env={"REPRO_TEST_MARKER_DIR": str(marker)},
    )
    assert len(list(marker.iterdir())) >= 2  # both workers called the user's function (every epoch)
    assert result["params"] == reference["params"]  # and the seeding that follows it is still ours
    assert result["optimizer"] == reference["optimizer"]
    assert [s["indices"] for s in runner.steps(out)] == [s["indices"] for s in runner.steps(ref_out)]


def test_pin_memory_and_no_shuffle(runs: Any) -> None:
    reference, _ = runs.reference({**BASE, "num_workers": 0, "shuffle": False})
    result, _ = runs.run({**BASE, "num_workers": 2, "shuffle": False, "pin_memory": True}, "pin-memory")
    assert result["params"] == reference["params"]


def test_two_train_dataloaders(runs: Any) -> None:
    reference, ref_out = runs.reference({**BASE, "num_workers": 0, "two_loaders": True})
    result, out = runs.run({**BASE, "num_workers": 2, "two_loaders": True}, "two-loaders")
    assert result["params"] == reference["params"]
    # the shorter loader cycles (several passes per epoch): its batches are identical too
    short = [tuple(s["indices"][1]) for s in runner.steps(out)]
    assert short == [tuple(s["indices"][1]) for s in runner.steps(ref_out)]


def test_dataloaders_recreated_every_epoch(runs: Any) -> None:
    """``reload_dataloaders_every_n_epochs``: Lightning asks the module for new loaders each epoch."""
    reference, ref_out = runs.reference({**BASE, "num_workers": 0, "max_epochs": 3})
    result, out = runs.run({**BASE, "num_workers": 2, "max_epochs": 3, "reload_every_epoch": True}, "reload")
    assert result["params"] == reference["params"]
    assert [s["indices"] for s in runner.steps(out)] == [s["indices"] for s in runner.steps(ref_out)]
    epochs = [[s["indices"] for s in runner.steps(out) if s["epoch"] == e] for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]  # each epoch has its own order
