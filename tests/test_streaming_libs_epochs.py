"""The streaming libraries (tests/streaming_pipelines.py) resumed at and after an epoch's end: from an epoch-end
checkpoint, from a file written before the first resumed batch, and the epochs after a resumed one.

The runs and comparisons of ``tests/test_streaming_libs.py`` (``tests/streaming_cases.py``), in a file of their own so
that the two workers of the marked run (scripts/test.sh) share the load (``--dist loadfile``).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import runner
import streaming_pipelines
from streaming_cases import assert_same_run, base_cfg, killed_and_resumed, resume_line
from streaming_pipelines import rows

pytestmark = [pytest.mark.streaming, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return streaming_pipelines.written_data(tmp_path_factory.mktemp("streaming-data"))


# ------------------------------------------------------------------------------------------- killed at an epoch end
# (library, workers, other options): where what a pass leaves to the next one lives. On restart Lightning creates a
# throwaway iterator of epoch 1 before the real one, whose reads must not leak into the real pass
EPOCH_ENDS = [
    # detshuffle counts its passes in the main process's copy: the resumed one counts on from the record's
    pytest.param("wds_det", 0, {}, id="webdataset-detshuffle-0"),
    # and in persistent workers' copies, which the throwaway iterator's pass already moved on
    pytest.param("wds_det", 2, {"persistent_workers": True}, id="webdataset-detshuffle-2-persistent"),
    # HF's epoch through set_epoch (Lightning does not rerun on_train_epoch_start there), torchdata's loader state
    pytest.param("hf_sdl", 2, {}, id="hf-statefuldataloader-2"),
    # litdata's loader counts its passes, and Lightning does not load its state after an epoch-end checkpoint: the
    # count is given back from that state (else epoch 0's order again)
    pytest.param("litdata", 0, {}, id="litdata-0"),
    pytest.param("litdata", 2, {}, id="litdata-2"),
    # written by step on the epoch's last batch (no validation due there): Lightning restarts in the epoch, loads the
    # loader's state of a pass read to its end and fetches once more, where litdata started its next pass (a batch
    # trained more in epoch 0, saying `exact`); resumed, that pass gives none, and the next epoch reads it
    pytest.param("litdata", 2, {"by_step": True}, id="litdata-2-last-batch"),
]


@pytest.mark.parametrize(("lib", "workers", "extra"), EPOCH_ENDS)
def test_killed_after_an_epoch_end_checkpoint_resumes_bitwise(
    runs: Any, data: str, lib: str, workers: int, extra: dict[str, Any]
) -> None:
    """Killed after 11 batches, resumed from the checkpoint ``ModelCheckpoint(every_n_epochs=1)`` wrote at the end
    of epoch 0 (``by_step``: the one ``every_n_train_steps=5`` wrote on its last batch); the reference is the
    mid-epoch test's (the resumed run's files are compared with its files)."""
    by_step = extra.pop("by_step", False)
    cfg = {**base_cfg(data, lib, workers), **extra, "ckpt_every_n_steps": 6}
    ref, ref_out = runs.reference(cfg)
    saves = {"ckpt_every_n_steps": 5} if by_step else {"ckpt_every_n_epochs": 1}
    _, killed = runs.run({**cfg, **saves, "kill_after_batches": 11}, "epoch-end", expect_kill=True)
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[::2] == (10, 0), "the test means to resume at the end of epoch 0"
    resumed, out = runs.run({**cfg, "resume": str(last)}, "epoch-end-resumed")
    line = resume_line(resumed["stderr"])
    for key in ("params", "optimizer", "global_step", "epoch", "lr"):
        assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run"
    assert rows(runner.stitched_runs([killed, out])) == rows(runner.steps(ref_out)), "the logged step rows differ"
    assert runner.epochs(out) == runner.epochs(ref_out)  # epoch 0's values logged again, as they were
    streaming_pipelines.assert_same_files(ref_out, out)
    assert ": exact (restore verified:" in line, line
    if lib == "litdata" and not by_step:
        assert "its loader given back its pass count (current_epoch=1) from its saved state" in line, line
    elif by_step:
        assert "a new pass after the epoch's last batch, its loader's state loaded (pass 1)" in line, line


@pytest.mark.parametrize(
    "lib",
    [
        # torchdata's StatefulDataLoader makes an iterator (its workers begin a pass) when asked its state without one,
        # which Lightning's teardown left: the file lacked the ended pass's record (params differed, said NOT exact)
        pytest.param("hf_sdl", id="hf-statefuldataloader-2"),
        # a Loader's own state is not loaded by Lightning there (the next epoch starts): the line said NOT exact
        pytest.param("nodes", id="torchdata-nodes-2"),
    ],
)
def test_a_file_saved_after_fit_at_an_epochs_end_resumes_bitwise(runs: Any, data: str, lib: str) -> None:
    """``fit`` stopped by ``max_steps`` at epoch 0's end, ``trainer.save_checkpoint`` after it, resumed."""
    cfg = {**base_cfg(data, lib, 2), "ckpt_every_n_steps": 6}
    ref, ref_out = runs.reference(cfg)
    path = Path(runs.root, f"after-fit-{lib}.ckpt")
    _, first = runs.run({**cfg, "max_steps": 10, "save_at_end": str(path)}, "after-fit")
    resumed, out = runs.run({**cfg, "resume": str(path)}, "after-fit-resumed")
    assert_same_run(ref, ref_out, [first, out], resumed)
    line = resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line


# (library, workers, options, killed after, last.ckpt at (step, batches)): a file written in the resumed process before
# the first resumed batch, by the rest of the checkpoint's hook or a validation due at its batch
# last.ckpt on epoch 0's last batch (step 10), where a validation is due and the epoch's files are written
LAST_BATCH = {"val": 5, "ckpt_every_n_steps": 5, "ckpt_every_n_epochs": 1, "ckpt_monitor_every_n_steps": 5}
BEFORE_FIRST_BATCH = [
    # the validation due at batch 12 runs first; its file comes before worker 1 sent a batch of the resumed pass:
    # torchdata's loader must report worker 1's saved snapshot entry, not its fresh start's (data/loaderstate.py)
    pytest.param(
        "hf_sdl", 2, {"val": 3, "accumulate": 2, "ckpt_monitor_every_n_steps": 2}, 13, (6, 12), id="hf-sdl-2"
    ),
    # last.ckpt at step 12 by the step callback, then the monitored one writes best-step=12 in the same hook: the
    # resume writes it again before litdata's pass starts. litdata's state_dict() writes its main copy's epoch into
    # the loaded state the workers read (they read epoch 0's order: the weights differed), reports the turn after
    # the loaded one, and our record of the pass (not begun) was missing from the file
    pytest.param("litdata", 2, {"val": 3, "ckpt_monitor_every_n_steps": 3}, 13, (12, 12), id="litdata-2"),
    pytest.param("litdata", 0, {"val": 3, "ckpt_monitor_every_n_steps": 3}, 13, (12, 12), id="litdata-0"),
    # last.ckpt on epoch 0's last batch (step 10), the validation due there runs first: the resumed pass has nothing
    # left, and torchdata's loader reports a new iterator's counters (0 yielded) where the uninterrupted run's reports
    # the finished pass's: the saved state is reported until a batch is read or another pass begins
    pytest.param("hf_sdl", 2, LAST_BATCH, 11, (10, 10), id="hf-sdl-2-epoch-end"),
    # the same on litdata: our record of the pass (ended) and litdata's loaded turn in the validation's files, and the
    # resume line exact (Lightning loads the loader's own state there, with its pass count)
    pytest.param("litdata", 2, LAST_BATCH, 11, (10, 10), id="litdata-2-epoch-end"),
]


@pytest.mark.parametrize(("lib", "workers", "extra", "kill_after", "at"), BEFORE_FIRST_BATCH)
def test_a_file_written_before_the_first_resumed_batch_holds_what_the_uninterrupted_runs_does(
    runs: Any, data: str, lib: str, workers: int, extra: dict[str, Any], kill_after: int, at: tuple[int, int]
) -> None:
    """A step checkpoint every 6 steps with ``last.ckpt``, a monitored one, validation every 3 batches; killed and
    resumed from ``last.ckpt`` in its folder (``resumed_in_place``: every file of the folder compared with the
    uninterrupted run's, every value), the weights and the resume line too."""
    cfg = {**base_cfg(data, lib, workers), "ckpt_every_n_steps": 6, "save_last": True, **extra}
    ref, _, resumed, _ = runs.resumed_in_place(cfg, kill_after, at)
    for key in ("params", "optimizer", "global_step"):
        assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run"
    assert ": exact (restore verified:" in resume_line(resumed["stderr"])


# ------------------------------------------------------------------------------------------- the epochs after
# (library, workers): 3 epochs, gradient accumulation 2, validation every 4 batches, checkpoints every 3 steps, killed
# after 15 batches and resumed from step 6 (epoch 1's third batch): the resumed epoch and a whole epoch after it
AFTER = [("litdata", 0), ("litdata", 2), ("hf_sdl", 2), ("wds_det", 2)]


@pytest.mark.parametrize(("lib", "workers"), AFTER, ids=[f"{lib}-{w}" for lib, w in AFTER])
def test_the_epoch_after_a_resumed_one_is_whole(runs: Any, data: str, lib: str, workers: int) -> None:
    """The epoch after the resumed one reads its whole pass. litdata's loader keeps ``restore`` (set by
    ``load_state_dict``) until a pass runs to its end, which Lightning's sized epochs never ask for: plain Lightning
    then reads what the loaded position had left in the next epoch too (2 batches of 10 here), and trains 11 steps
    where the uninterrupted run trains 15; the first litdata case shows it."""
    cfg = {**base_cfg(data, lib, workers), "max_epochs": 3, "accumulate": 2, "val": 4, "ckpt_every_n_steps": 3}
    ref, ref_out = runs.reference(cfg)
    killed = runs.killed({**cfg, "kill_after_batches": 15})
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last) == (6, 12, 1), "the test means to resume at epoch 1's third batch"
    resumed, out = runs.run({**cfg, "resume": str(last)}, "resumed-3-epochs")
    assert [r["batch_idx"] for r in runner.steps(out) if r["epoch"] == 2] == list(range(10)), "epoch 2 is not whole"
    assert_same_run(ref, ref_out, [killed, out], resumed)
    assert ": exact (restore verified:" in resume_line(resumed["stderr"])
    if (lib, workers) == AFTER[0]:
        plain = {**cfg, "repro": False}
        ref_plain, _ = runs.run(plain, "plain-3-epochs")
        killed_plain = runs.run({**plain, "kill_after_batches": 15}, "plain-killed", expect_kill=True)[1]
        plain_resumed, plain_out = runs.run(
            {**plain, "resume": str(runner.checkpoints(killed_plain)[-1])}, "plain-resumed"
        )
        assert (ref_plain["global_step"], plain_resumed["global_step"]) == (15, 11), "plain Lightning changed"
        assert [r["batch_idx"] for r in runner.steps(plain_out) if r["epoch"] == 2] == [0, 1]


# litdata's reader builds tensors on read-only bytes: torch warns once a process (the first test there to read fails)
@pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")
def test_end_loaded_pass_clears_only_a_loaded_litdata_loaders_restore(data: str) -> None:
    import litdata
    from torch.utils.data import DataLoader

    from lightning_repro.data.libraries import end_loaded_pass

    def loader() -> Any:
        return litdata.StreamingDataLoader(litdata.StreamingDataset(str(Path(data, "litdata"))), batch_size=4)

    first = loader()
    it = iter(first)
    next(it), next(it)
    loaded = loader()
    loaded.load_state_dict(first.state_dict())
    assert loaded.restore is True
    assert end_loaded_pass(loaded)
    assert loaded.restore is False
    assert not end_loaded_pass(loaded)  # nothing to clear twice
    fresh = loader()
    assert not end_loaded_pass(fresh)
    assert fresh.restore is False
    assert not end_loaded_pass(DataLoader(list(range(4))))  # not litdata's


# ------------------------------------------------------------------------------------------- validation on a stream
@pytest.mark.parametrize(
    ("lib", "spec"),
    [
        # litdata's loader gives its dataset its count of passes (the shuffle's seed) in the main process; persistent
        # workers keep the copy of their first pass
        pytest.param("litdata", {}, id="litdata"),
        # detshuffle counts its passes in each persistent worker's copy; batched in the pipeline (batch_size=None):
        # no batch request reaches the workers, the pass's count goes with its key through shared memory
        pytest.param("wds_det", {"batched": True}, id="webdataset-detshuffle-batched"),
    ],
)
def test_a_shuffled_validation_loader_with_persistent_workers_resumes_bitwise(
    runs: Any, data: str, lib: str, spec: dict[str, Any]
) -> None:
    """Validation every 5 batches on a shuffled loader of the pipeline with 2 persistent workers; killed mid-epoch 1
    and resumed: the validations after the resume read the uninterrupted run's batches (every logged row, every
    file). Their copies counted their passes from the resumed run's sanity check, a count the uninterrupted run's
    copies had not reached: other batches, while the resume line said `exact`."""
    cfg = {**base_cfg(data, lib, 2, val_persistent=True, **spec), "val": 5, "csv_logger": True}
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    outs, resumed = killed_and_resumed(runs, cfg, False)
    assert_same_run(ref, ref_out, outs, resumed)
    validated = _validations(ref_out)
    assert [step for step, _ in validated] == [4, 9, 14, 19], validated  # after batches 5, 10, 15, 20
    assert _validations(outs[0], before=12) + _validations(outs[1]) == validated
    line = resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line


def _validations(out: str, before: int | None = None) -> list[tuple[int, str]]:
    """The (step, val_loss) rows of a run's CSV log (``before``: those of steps before it)."""
    with Path(out, "logs", "metrics.csv").open() as f:
        rows = [(int(r["step"]), r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")]
    return [r for r in rows if before is None or r[0] < before]


# ------------------------------------------------------------------------------------------- built before the restore
@pytest.mark.parametrize(
    ("lib", "extra", "epoch_end"),
    [
        # the early iterator's persistent workers copied the dataset before the resumed position was given to it;
        # webdataset's own loader (wds.WebLoader(pipeline.batched(4), batch_size=None)): the DataLoader inside it's
        pytest.param(
            "wds_det",
            {"persistent_workers": True, "spec": {"batched": True, "webloader": True}},
            False,
            id="webdataset-webloader-2-persistent",
        ),
        # positioned by its own state, which Lightning loads only into a loader it builds after the restore
        pytest.param("nodes", {}, False, id="nodes-2"),
        # the early iterator's pass, of a fresh run's epoch 0, was taken for the resumed epoch's
        pytest.param("nodes", {}, True, id="nodes-2-epoch-end"),
    ],
)
def test_a_loader_built_before_the_restore_resumes_bitwise(
    runs: Any, data: str, lib: str, extra: dict[str, Any], epoch_end: bool
) -> None:
    """``OneCycleLR`` sized by ``trainer.estimated_stepping_batches`` in ``configure_optimizers``: Lightning builds the
    train loader and its iterator before the checkpoint is restored, and neither loads the loaders' saved states nor
    makes the iterator again (litdata's case: ``tests/test_ordinary_project.py``). Killed mid-epoch 1 (or after the
    epoch-end checkpoint of epoch 0) and resumed: the uninterrupted run's every row and file, and `exact`."""
    options = {k: v for k, v in extra.items() if k != "spec"}
    cfg = {**base_cfg(data, lib, 2, **extra.get("spec", {})), **options, "scheduler": "onecycle"}
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    if epoch_end:  # as test_killed_after_an_epoch_end_checkpoint_resumes_bitwise: only the killed run writes by epoch
        saves = {"ckpt_every_n_steps": 6, "ckpt_every_n_epochs": 1, "kill_after_batches": 11}
        _, killed = runs.run({**cfg, **saves}, "epoch-end", expect_kill=True)
        last = runner.checkpoints(killed)[-1]
        assert runner.checkpoint_position(last)[::2] == (10, 0), last
        resumed, out = runs.run({**cfg, "ckpt_every_n_steps": 6, "resume": str(last)}, "resumed")
        for key in ("params", "optimizer", "global_step", "epoch", "lr"):
            assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run"
        assert rows(runner.stitched_runs([killed, out])) == rows(runner.steps(ref_out)), "the logged step rows differ"
        streaming_pipelines.assert_same_files(ref_out, out)
    else:
        outs, resumed = killed_and_resumed(runs, cfg, False)
        assert_same_run(ref, ref_out, outs, resumed)
    line = resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line
