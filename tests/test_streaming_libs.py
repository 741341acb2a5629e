"""The streaming libraries users train from, each as its docs show (tests/streaming_pipelines.py), killed and resumed.

Every run is a fresh process (tests/scenario.py): 40 items in 4 shards, batch 4 (10 batches an epoch), 2 epochs,
augmentation from torch's global RNG in the library's ``map``/transform, checkpoints every 6 steps, killed with
SIGKILL after 14 batches and resumed from step 12: mid-epoch 1 (the pipelines whose loader keeps its own state:
that run killed again after its step-18 checkpoint and resumed from that file). Compared with the uninterrupted
run: SHA-256 of the weights and the optimizer state, every step's sample indices and loss bits, the epoch-level
logged values and every value of every checkpoint file the runs wrote. The stage of its own in scripts/test.sh
(``-m streaming``).
"""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import runner
import streaming_pipelines
from streaming_pipelines import rows

pytestmark = [pytest.mark.streaming, pytest.mark.slow]

BASE: dict[str, Any] = {"batch_size": 4, "dim": streaming_pipelines.DIM, "val": "off", "max_epochs": 2}
KILL = {"ckpt_every_n_steps": 6, "kill_after_batches": 14}  # the last checkpoint: step 12, epoch 1's third batch


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return streaming_pipelines.written_data(tmp_path_factory.mktemp("streaming-data"))


def _cfg(data: str, lib: str, workers: int) -> dict[str, Any]:
    return {**BASE, "pipeline": {"lib": lib, "data": data}, "num_workers": workers}


def _resume_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("lightning-repro: resumed from")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def _assert_same_run(ref: dict[str, Any], ref_out: str, outs: list[str], resumed: dict[str, Any]) -> None:
    """``outs``: the killed run's folder, then each run resumed from the one before (``resumed``: the last's result)."""
    for key in ("params", "optimizer", "global_step", "epoch", "lr"):
        assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run"
    assert rows(runner.stitched_runs(outs)) == rows(runner.steps(ref_out)), "the logged step rows differ"
    finished = runner.epochs(outs[-1])
    assert finished, "the resumed run finished no epoch"
    assert finished == {e: v for e, v in runner.epochs(ref_out).items() if e in finished}
    streaming_pipelines.assert_same_files(ref_out, *outs)  # every file each run wrote, every value


def _killed_and_resumed(runs: Any, cfg: dict[str, Any], twice: bool) -> tuple[list[str], dict[str, Any]]:
    """Killed after 14 batches and resumed from step 12; ``twice``: that run killed again after its step-18
    checkpoint and resumed from that file (a file written after a resume must hold what the uninterrupted run's
    holds, so a second resume is exact too). The folders of the runs, and the last run's result."""
    killed = runs.killed({**cfg, **KILL})
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[:2] == (12, 12), "the test means to resume mid-epoch 1"
    outs = [killed]
    if twice:
        again = {**cfg, **KILL, "kill_after_batches": 7, "resume": str(last)}
        _, out = runs.run(again, "killed-again", expect_kill=True)
        last = runner.checkpoints(out)[-1]
        assert runner.checkpoint_position(last)[:2] == (18, 18), "the second resume is meant from epoch 1's 9th batch"
        outs.append(out)
    resumed, out = runs.run({**cfg, "ckpt_every_n_steps": 6, "resume": str(last)}, "resumed")
    return [*outs, out], resumed


# ------------------------------------------------------------------------------------------- litdata
def test_litdata_checkpoints_without_a_crash(runs: Any, data: str) -> None:
    """Our entry once called ``StreamingDataset.state_dict()`` without its three arguments: a TypeError."""
    result, out = runs.run({**_cfg(data, "litdata", 0), "ckpt_every_n_steps": 6}, "litdata-ckpt")
    files = runner.checkpoints(out)
    assert [runner.checkpoint_position(f)[0] for f in files] == [6, 12, 18]
    import torch

    saved = torch.load(files[0], weights_only=True)
    # Lightning saved the loader's own state (through our private copy of the loader), as it does without us
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["num_samples_yielded"] == 6 * 4
    assert "DeterminismCallback" in saved["callbacks"]
    assert result["global_step"] == 20


# ------------------------------------------------------------------------------------------- killed and resumed
# (library, workers, what the resume line says of the path the position took, resumed twice, other options).
# Twice: the pipelines whose loader keeps a state of its own in the checkpoint, which a second resume reads
# (litdata's positions the pass; torchdata's counters are only written back)
RESUMES = [
    pytest.param("litdata", 0, "the StreamingDataLoader's own state", False, {}, id="litdata-0"),
    pytest.param("litdata", 2, "the StreamingDataLoader's own state", True, {}, id="litdata-2-twice"),
    # two litdata datasets mixed (CombinedStreamingDataset: 80 items, 20 batches an epoch): its loader unwraps the
    # counts from the items (our stamp once hid them: a crash at the first batch)
    pytest.param("litdata_combined", 0, "the StreamingDataLoader's own state", False, {}, id="litdata-combined-0"),
    # two read side by side (ParallelStreamingDataset) with a transform drawing from the generators litdata gives it,
    # seeded at each pass from the items read: a resumed pass drew other values (plain Lightning too); 3 epochs
    pytest.param(
        "litdata_parallel", 2, "the StreamingDataLoader's own state", False, {"max_epochs": 3}, id="litdata-parallel-2"
    ),
    pytest.param("hf", 0, "a fast-forward of", False, {}, id="hf-json-0"),
    # persistent workers: HF shares its epoch with them (set_epoch updates a tensor in shared memory)
    pytest.param(
        "hf_parquet", 2, "a fast-forward of", False, {"persistent_workers": True}, id="hf-parquet-2-persistent"
    ),
    pytest.param("hf_sdl", 0, "a fast-forward of", False, {}, id="hf-statefuldataloader-0"),
    pytest.param("hf_sdl", 2, "a fast-forward of", True, {}, id="hf-statefuldataloader-2-twice"),
    # webdataset with workers 0: the detshuffle pipeline's case below (the main process reads either pipeline alike)
    pytest.param("wds", 2, "a fast-forward of", False, {}, id="webdataset-2"),
    pytest.param("wds_det", 0, "a fast-forward of", False, {}, id="webdataset-detshuffle-0"),
    pytest.param("wds_det", 2, "a fast-forward of", False, {}, id="webdataset-detshuffle-2"),
]


@pytest.mark.parametrize(("lib", "workers", "path", "twice", "extra"), RESUMES)
def test_killed_mid_epoch_resumes_bitwise(
    runs: Any, data: str, lib: str, workers: int, path: str, twice: bool, extra: dict[str, Any]
) -> None:
    cfg = {**_cfg(data, lib, workers), **extra}
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    outs, resumed = _killed_and_resumed(runs, cfg, twice)
    _assert_same_run(ref, ref_out, outs, resumed)
    if lib.startswith("hf") and workers:  # the epoch the module gave HF (1) is the one its workers read epoch 1 with
        record = runner.stream_record(runner.checkpoints(outs[0])[-1])
        assert (record["dataset_epoch"], record["workers_epoch"]) == (1, 1), record
    line = _resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line
    assert path in line, line


@pytest.mark.parametrize(
    ("lib", "workers"), [("wds", 2), ("hf", 0), ("litdata", 2)], ids=["webdataset-2", "hf-0", "litdata-2"]
)
def test_a_modules_batch_end_hook_runs_again_with_the_streamed_batch(
    runs: Any, data: str, lib: str, workers: int
) -> None:
    """The module's ``on_train_batch_end`` moves an EMA teacher with the batch and logs it; the step checkpoint is
    written before it runs. A streamed batch is not read again on resume: the file keeps it, and the resumed run
    runs the hook with it (before, the teacher missed that update and the resume said "NOT exact")."""
    cfg = {**_cfg(data, lib, workers), "teacher": True}
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    outs, resumed = _killed_and_resumed(runs, cfg, False)
    _assert_same_run(ref, ref_out, outs, resumed)  # the teacher in every later file
    line = _resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line


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
]


@pytest.mark.parametrize(("lib", "workers", "extra"), EPOCH_ENDS)
def test_killed_after_an_epoch_end_checkpoint_resumes_bitwise(
    runs: Any, data: str, lib: str, workers: int, extra: dict[str, Any]
) -> None:
    """Killed after 11 batches, resumed from the checkpoint ``ModelCheckpoint(every_n_epochs=1)`` wrote at the end
    of epoch 0; the reference is the mid-epoch test's (the resumed run's files are compared with its files)."""
    cfg = {**_cfg(data, lib, workers), **extra, "ckpt_every_n_steps": 6}
    ref, ref_out = runs.reference(cfg)
    _, killed = runs.run({**cfg, "ckpt_every_n_epochs": 1, "kill_after_batches": 11}, "epoch-end", expect_kill=True)
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[::2] == (10, 0), "the test means to resume at the end of epoch 0"
    resumed, out = runs.run({**cfg, "resume": str(last)}, "epoch-end-resumed")
    line = _resume_line(resumed["stderr"])
    for key in ("params", "optimizer", "global_step", "epoch", "lr"):
        assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run"
    assert rows(runner.stitched_runs([killed, out])) == rows(runner.steps(ref_out)), "the logged step rows differ"
    assert runner.epochs(out) == runner.epochs(ref_out)  # epoch 0's values logged again, as they were
    streaming_pipelines.assert_same_files(ref_out, out)
    assert ": exact (restore verified:" in line, line
    if lib == "litdata":
        assert "its loader given back its pass count (current_epoch=1) from its saved state" in line, line


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
    cfg = {**_cfg(data, lib, workers), "ckpt_every_n_steps": 6, "save_last": True, **extra}
    ref, _, resumed, _ = runs.resumed_in_place(cfg, kill_after, at)
    for key in ("params", "optimizer", "global_step"):
        assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run"
    assert ": exact (restore verified:" in _resume_line(resumed["stderr"])


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
    cfg = {**_cfg(data, lib, workers), "max_epochs": 3, "accumulate": 2, "val": 4, "ckpt_every_n_steps": 3}
    ref, ref_out = runs.reference(cfg)
    killed = runs.killed({**cfg, "kill_after_batches": 15})
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last) == (6, 12, 1), "the test means to resume at epoch 1's third batch"
    resumed, out = runs.run({**cfg, "resume": str(last)}, "resumed-3-epochs")
    assert [r["batch_idx"] for r in runner.steps(out) if r["epoch"] == 2] == list(range(10)), "epoch 2 is not whole"
    _assert_same_run(ref, ref_out, [killed, out], resumed)
    assert ": exact (restore verified:" in _resume_line(resumed["stderr"])
    if (lib, workers) == AFTER[0]:
        plain = {**cfg, "repro": False}
        ref_plain, _ = runs.run(plain, "plain-3-epochs")
        killed_plain = runs.run({**plain, "kill_after_batches": 15}, "plain-killed", expect_kill=True)[1]
        plain_resumed, plain_out = runs.run(
            {**plain, "resume": str(runner.checkpoints(killed_plain)[-1])}, "plain-resumed"
        )
        assert (ref_plain["global_step"], plain_resumed["global_step"]) == (15, 11), "plain Lightning changed"
        assert [r["batch_idx"] for r in runner.steps(plain_out) if r["epoch"] == 2] == [0, 1]


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


# ------------------------------------------------------------------------------------------- webdataset's shuffles
@pytest.mark.parametrize(("lib", "workers"), [("wds", 2), ("wds_det", 0)], ids=["shuffle-seed-2", "detshuffle-0"])
def test_a_seeded_webdataset_pipeline_repeats_bitwise(runs: Any, data: str, lib: str, workers: int) -> None:
    cfg = {**_cfg(data, lib, workers), "ckpt_every_n_steps": 6}
    first, first_out = runs.reference(cfg)  # the reference of the resume test
    again, again_out = runs.run(cfg, f"{lib}-again")
    assert (again["params"], again["optimizer"]) == (first["params"], first["optimizer"])
    assert rows(runner.steps(again_out)) == rows(runner.steps(first_out))
    assert "NotExactWarning" not in again["stderr"]
    if lib == "wds_det":  # detshuffle's own pass count reseeds it: epoch 1 reads another order (what a resume keeps)
        order = [[i for s in runner.steps(first_out) if s["epoch"] == e for i in s["indices"]] for e in (0, 1)]
        assert sorted(order[0]) == sorted(order[1])
        assert order[0] != order[1]


def test_detshuffle_counts_its_passes_in_the_copy_that_iterates(data: str) -> None:
    """What the takeover records and gives back: each ``detshuffle`` stage's own count, found in either form."""
    import webdataset as wds

    from lightning_repro.data.libraries import set_stage_epochs, stage_epochs

    pipeline = streaming_pipelines.train_loader(_cfg(data, "wds_det", 0), 0, 1).dataset
    assert stage_epochs(pipeline) == [-1, -1]  # the shard and the sample shuffle, not yet iterated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # webdataset leaves its tar files to the garbage collector
        first = [item["i"] for item in pipeline]
        assert stage_epochs(pipeline) == [0, 0]
        assert [item["i"] for item in pipeline] != first  # its second pass: seeded from (seed, 1)
        set_stage_epochs(pipeline, [-1, -1])  # a fresh process's counts: the first pass's order again
        assert [item["i"] for item in pipeline] == first
        gc.collect()
    urls = sorted(str(p) for p in Path(data, "wds").glob("*.tar"))
    fluid = wds.WebDataset(urls, shardshuffle=4, detshuffle=True, seed=1).compose(wds.detshuffle(8, seed=1))
    assert stage_epochs(fluid) == [-1, -1]
    assert stage_epochs(streaming_pipelines.train_loader(_cfg(data, "wds", 0), 0, 1).dataset) is None


def test_an_unseeded_webdataset_shuffle_warns_once_at_takeover(data: str) -> None:
    from helpers import prepare

    from lightning_repro import NotExactWarning

    cfg = {**_cfg(data, "wds_unseeded", 0)}
    loader = streaming_pipelines.train_loader(cfg, 0, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare(loader)
    ours = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
    assert len(ours) == 1, ours
    assert "`.shuffle(8)` (webdataset) seeds itself from the process id and the clock" in ours[0]
    assert "cannot be repeated" in ours[0]
    assert "`.shuffle(8, seed=...)`" in ours[0]
    with warnings.catch_warnings(record=True) as seeded:  # the seeded pipeline: nothing to say
        warnings.simplefilter("always")
        prepare(streaming_pipelines.train_loader(_cfg(data, "wds", 0), 0, 1))
    assert [str(w.message) for w in seeded if issubclass(w.category, NotExactWarning)] == []


def test_an_unseeded_webdataset_resume_says_not_exact(runs: Any, data: str) -> None:
    cfg = _cfg(data, "wds_unseeded", 0)
    _, killed = runs.run({**cfg, **KILL}, "wds-unseeded-killed", expect_kill=True)
    resumed, _ = runs.run({**cfg, "resume": str(runner.checkpoints(killed)[-1])}, "wds-unseeded-resumed")
    line = _resume_line(resumed["stderr"])
    assert ": NOT exact: " in line, line
    assert "`.shuffle(8)` (webdataset) seeds itself from the process id and the clock" in line, line


def test_a_litdata_mix_read_by_workers_resumes_bitwise_mid_epoch_and_from_an_epoch_end(runs: Any, data: str) -> None:
    """litdata's ``CombinedStreamingDataset`` with 2 persistent workers, each picking the dataset of every item at
    random. Its loader's state gives each dataset the items read of it by both workers together, which each dataset
    deals out as if every worker had read it alike: the resumed workers read other items (plain Lightning too). Each
    worker's datasets are put at that worker's own items (``data/litdatamix.py``), and a persistent worker forgets
    that state at its next pass: resumed from step 12 (mid-epoch) and, in the killed run's folder, from the epoch-end
    checkpoint, the weights and every file equal the uninterrupted run's."""
    # a checkpoint every 3 steps: a file 3 batches after the resume names the worker that read last (litdata's loader
    # shares the loaded counts with its state: that file once named the loaded one)
    # persistent workers: their copies keep what was loaded before their first pass, stale at the next one
    cfg = {**_cfg(data, "litdata_combined", 2), "ckpt_every_n_steps": 3, "ckpt_every_n_epochs": 1}
    cfg["persistent_workers"] = True
    ref, ref_out = runs.reference(cfg)
    killed = runs.run({**cfg, "kill_after_batches": 21}, "combined-killed", expect_kill=True)[1]
    by_step = {runner.checkpoint_position(f)[0]: f for f in runner.checkpoints(killed)}
    mid, end = by_step[12], by_step[20]
    assert runner.checkpoint_position(end)[::2] == (20, 0), "the test means to resume at the end of epoch 0"
    assert _replay_differs(mid), "the test means a state litdata's own replay deals out wrongly"
    resumed_mid, mid_out = runs.run({**cfg, "resume": str(mid)}, "combined-mid")
    line = _resume_line(resumed_mid["stderr"])
    assert ": exact (restore verified:" in line, line
    assert "CombinedStreamingDataset: worker positions restored" in line, line
    for key in ("params", "optimizer", "global_step", "epoch", "lr"):
        assert resumed_mid[key] == ref[key], f"{key} differs from the uninterrupted run (from step 12)"
    assert rows(runner.stitched_runs([killed, mid_out])) == rows(runner.steps(ref_out)), "the logged rows differ"
    ignored = ("/callbacks/DeterminismCallback/manifest/", "/callbacks/DeterminismCallback/entry_sha256")
    later = [p.name for p in runner.checkpoints(mid_out)]  # from step 15: 3 batches after the resume
    assert later[0] == "epoch=0-step=15.ckpt", later
    problems = runner.compare_checkpoint_files(ref_out, mid_out, ignore=ignored, names=later)
    assert not problems, "\n".join(problems)
    resumed = runner.run({**cfg, "resume": str(end), "out": killed})  # in its folder, as a restarted job does
    assert ": exact (restore verified:" in _resume_line(resumed["stderr"])
    for key in ("params", "optimizer", "global_step", "epoch", "lr"):
        assert resumed[key] == ref[key], f"{key} differs from the uninterrupted run (from the epoch end)"
    problems = runner.compare_checkpoint_files(ref_out, killed, ignore=ignored)  # every file, every value
    assert not problems, "\n".join(problems)


def _replay_differs(path: Path) -> bool:
    """Whether litdata's own replay of ``path``'s loader state deals some dataset's items to the workers otherwise
    than they read them (what made its resume read other items)."""
    import torch
    from litdata.streaming.dataset import _replay_sampling

    state = torch.load(path, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    counts = state["num_samples_yielded"]  # per worker, per dataset
    for d in range(len(counts[0])):
        read = {w: counts[w][d] for w in counts}
        if _replay_sampling(sum(read.values()), 4, len(counts)) != read:
            return True
    return False


def test_the_total_dealt_to_a_worker_is_what_litdata_replays_for_it() -> None:
    """``litdatamix.replay_total`` against litdata's own replay, for every worker of 1 to 4, batch sizes 1 to 5."""
    from litdata.streaming.dataset import _replay_sampling

    from lightning_repro.data.litdatamix import replay_total

    for workers in range(1, 5):
        for batch_size in range(1, 6):
            for worker in range(workers):
                for items in range(0, 23):
                    total = replay_total(items, batch_size, worker, workers)
                    assert _replay_sampling(total, batch_size, workers)[worker] == items, (items, batch_size, worker)


def test_litdatas_parallel_reading_with_persistent_workers_resumed_after_their_first_pass_says_not_exact(
    runs: Any, data: str
) -> None:
    """Each persistent worker's copy of a ``ParallelStreamingDataset`` counts its datasets' epochs itself (the one
    read to its end moves on, the other not): no state records it. Resumed in epoch 1, the line says so, truly."""
    cfg = {**_cfg(data, "litdata_parallel", 2), "persistent_workers": True}
    ref, _ = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    _, resumed = _killed_and_resumed(runs, cfg, False)
    line = _resume_line(resumed["stderr"])
    assert ": NOT exact: the data position is not restored exactly" in line, line
    assert "each worker's copy counts the epochs of its datasets itself" in line, line
    assert resumed["params"] != ref["params"]  # the control: what it says is true


def test_the_generators_litdata_gives_a_transform_are_keyed_and_its_mix_picks_left_to_litdata(data: str) -> None:
    """``ParallelStreamingDataset``'s iterator holds the transform's generators (keyed per item); the mix iterator of
    ``CombinedStreamingDataset`` holds the picks' ``random.Random``, which litdata replays itself on resume."""
    from lightning_repro.data.generators import iterator_generators

    parallel = streaming_pipelines._litdata_parallel(Path(data))
    found = iterator_generators(iter(parallel), [])
    assert sorted(g.path for g in found) == [f"iter()._rngs[{k!r}]" for k in ("numpy", "random", "torch")]
    assert len({g.salt for g in found}) == 3
    assert iterator_generators(iter(streaming_pipelines._litdata_combined(Path(data))), []) == []


# ------------------------------------------------------------------------------------------- another num_workers
# (library, what on_topology_change="reseed" does with the rest of epoch 1, the epoch's items read after the resume)
TOPOLOGY = [
    # litdata's elastic resume deals the items not consumed out to the new workers: each item of the epoch once
    pytest.param("litdata", "the loader deals the rest of the epoch out to the new workers", 32, id="litdata-redeal"),
    # torchdata refuses a state of another worker count (an AssertionError once, at the first batch): ours first
    pytest.param("hf_sdl", "the epoch's data starts over on the new workers", 40, id="hf-statefuldataloader"),
]


@pytest.mark.parametrize(("lib", "goes_on", "after"), TOPOLOGY)
def test_another_num_workers_is_refused_or_reseeded(runs: Any, data: str, lib: str, goes_on: str, after: int) -> None:
    cfg = _cfg(data, lib, 2)
    killed = runs.killed({**cfg, **KILL})  # the resume test's
    moved = {**cfg, "num_workers": 4, "resume": str(runner.checkpoints(killed)[-1])}
    code, _, stderr = runner.execute([str(runner.SCENARIO), json.dumps({**moved, "out": runs.fresh_dir("topology")})])
    assert code != 0
    [error] = [line for line in stderr.splitlines() if line.startswith("lightning_repro.exceptions.TopologyError")]
    name = {"litdata": "StreamingDataset (litdata)", "hf_sdl": "IterableDataset (HF datasets) read by"}[lib]
    assert f"train dataloader 0 over the IterableDataset {name}" in error, error
    assert "was checkpointed with num_workers=2 and is resumed with num_workers=4" in error, error
    assert "Resume with num_workers=2 (exact), or pass `on_topology_change='reseed'`" in error, error
    assert goes_on in error, error
    assert "AssertionError" not in stderr  # torchdata's own refusal
    resumed, out = runs.run({**moved, "on_topology_change": "reseed"}, "reseeded")
    line = _resume_line(resumed["stderr"])
    assert ": NOT exact: " in line, line
    assert goes_on in line, line
    epoch1 = [i for s in runner.steps(out) if s["epoch"] == 1 for i in s["indices"]]
    assert len(epoch1) == after, epoch1
    if lib == "litdata":  # the 8 items consumed before the checkpoint (steps 10 and 11) and the re-dealt ones
        epoch1 += [i for s in runner.steps(killed) if s["epoch"] == 1 and s["global_step"] < 12 for i in s["indices"]]
    assert sorted(epoch1) == list(range(40)), "an item of the epoch was missed or read twice"
