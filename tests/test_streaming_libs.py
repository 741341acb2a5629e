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
from streaming_cases import KILL, assert_same_run, base_cfg, killed_and_resumed, resume_line
from streaming_pipelines import rows

pytestmark = [pytest.mark.streaming, pytest.mark.slow]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return streaming_pipelines.written_data(tmp_path_factory.mktemp("streaming-data"))


# ------------------------------------------------------------------------------------------- litdata
def test_litdata_checkpoints_without_a_crash(runs: Any, data: str) -> None:
    """Our entry once called ``StreamingDataset.state_dict()`` without its three arguments: a TypeError."""
    result, out = runs.run({**base_cfg(data, "litdata", 0), "ckpt_every_n_steps": 6}, "litdata-ckpt")
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
    # two datasets mixed at random (interleave_datasets with probabilities and a seed, first_exhausted: epochs of
    # another length each), read by a StatefulDataLoader with workers
    pytest.param("hf_mix_sdl", 2, "a fast-forward of", True, {}, id="hf-interleaved-statefuldataloader-2-twice"),
    # webdataset with workers 0: the detshuffle pipeline's case below (the main process reads either pipeline alike)
    pytest.param("wds", 2, "a fast-forward of", False, {}, id="webdataset-2"),
    pytest.param("wds_det", 0, "a fast-forward of", False, {}, id="webdataset-detshuffle-0"),
    # shards drawn with replacement, deterministic (wds.ResampledShards(urls, deterministic=True), epochs of 20 items
    # a worker): each pass seeded from its own count of passes, counted in the persistent workers' copies; 3 epochs
    pytest.param(
        "wds_resampled_det",
        2,
        "a fast-forward of",
        False,
        {"persistent_workers": True, "max_epochs": 3},
        id="webdataset-resampled-deterministic-2-persistent",
    ),
    # webdataset's own loader as its docs write it (wds.WebLoader(pipeline.batched(4), batch_size=None)): a
    # DataPipeline over a DataLoader, once left as it was ("not a DataLoader": NOT exact)
    pytest.param(
        "wds_det",
        2,
        "a fast-forward of",
        False,
        {"spec": {"batched": True, "webloader": True}},
        id="webdataset-webloader-2",
    ),
    # its epochs cut from the loader repeated (with_epoch(15): a pass and a half; the checkpoint in the second
    # pass): the resumed epoch ends where the interrupted one would have, not 15 batches after the resume
    pytest.param(
        "wds_det",
        2,
        "a fast-forward of",
        False,
        {"spec": {"batched": True, "webloader": True, "with_epoch": 15}},
        id="webdataset-webloader-with_epoch-2",
    ),
    # its stages after the loader, run in the main process, as webdataset's docs write them
    # (.unbatched().shuffle(16, seed=...).map(jitter from torch).batched(4)): the resumed epoch's pass is read again
    # from its start through them and its consumed batches dropped (once left as it was: NOT exact). With epochs of
    # 15 batches cut across the loader's passes of 10 (with_epoch): killed in epoch 0's second pass (the epoch read
    # again from its first), then killed again in epoch 1's first pass after the resume (a file written then resumes)
    pytest.param(
        "wds_det",
        2,
        "the epoch's pass read again from its start through the WebLoader's stages",
        True,
        {"spec": {"batched": True, "webloader": True, "rebatch": "shuffle", "with_epoch": 15}},
        id="webdataset-webloader-stages-with_epoch-2-twice",
    ),
    pytest.param("wds_det", 2, "a fast-forward of", False, {}, id="webdataset-detshuffle-2"),
    # batched in the pipeline (`wds.batched`, a loader with batch_size=None, as webdataset's docs do), persistent
    # workers: no batch request tells them the pass, its key comes through shared memory (the run said exact and
    # differed from epoch 1 on); 3 epochs, so the resumed run's workers too start a pass after their first
    pytest.param(
        "wds_det",
        2,
        "a fast-forward of",
        False,
        {"persistent_workers": True, "max_epochs": 3, "spec": {"batched": True}},
        id="webdataset-batched-in-pipeline-2-persistent",
    ),
]


@pytest.mark.parametrize(("lib", "workers", "path", "twice", "extra"), RESUMES)
def test_killed_mid_epoch_resumes_bitwise(
    runs: Any, data: str, lib: str, workers: int, path: str, twice: bool, extra: dict[str, Any]
) -> None:
    cfg = {**base_cfg(data, lib, workers, **extra.get("spec", {})), **{k: v for k, v in extra.items() if k != "spec"}}
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    outs, resumed = killed_and_resumed(runs, cfg, twice)
    assert_same_run(ref, ref_out, outs, resumed)
    if lib.startswith("hf") and workers:  # the epoch the module gave HF is the one its workers read the epoch with
        record = runner.stream_record(runner.checkpoints(outs[0])[-1])  # epoch 1 (the mix: 0, its epochs are longer)
        assert (record["dataset_epoch"], record["workers_epoch"]) == (record["epoch"],) * 2, record
        assert record["epoch"] == (0 if lib.startswith("hf_mix") else 1), record
    line = resume_line(resumed["stderr"])
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
    cfg = {**base_cfg(data, lib, workers), "teacher": True}
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    outs, resumed = killed_and_resumed(runs, cfg, False)
    assert_same_run(ref, ref_out, outs, resumed)  # the teacher in every later file
    line = resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line


# ------------------------------------------------------------------------------------------- webdataset's shuffles
@pytest.mark.parametrize(("lib", "workers"), [("wds", 2), ("wds_det", 0)], ids=["shuffle-seed-2", "detshuffle-0"])
def test_a_seeded_webdataset_pipeline_repeats_bitwise(runs: Any, data: str, lib: str, workers: int) -> None:
    cfg = {**base_cfg(data, lib, workers), "ckpt_every_n_steps": 6}
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

    pipeline = streaming_pipelines.train_loader(base_cfg(data, "wds_det", 0), 0, 1).dataset
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
    assert stage_epochs(streaming_pipelines.train_loader(base_cfg(data, "wds", 0), 0, 1).dataset) is None


def test_an_unseeded_webdataset_shuffle_warns_once_at_takeover(data: str) -> None:
    from helpers import prepare

    from lightning_repro import NotExactWarning

    cfg = {**base_cfg(data, "wds_unseeded", 0)}
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
        prepare(streaming_pipelines.train_loader(base_cfg(data, "wds", 0), 0, 1))
    assert [str(w.message) for w in seeded if issubclass(w.category, NotExactWarning)] == []


def test_a_webloader_is_taken_over_through_its_dataloader_and_left_as_it_was(data: str) -> None:
    """``wds.WebLoader`` is a pipeline over a ``DataLoader``: Lightning gets a copy around our copy of that loader,
    whose items draw from their keys (the same in a second takeover, whatever the main process's streams), and the
    loader lookups see through it; the user's ``WebLoader`` and ``DataLoader`` are left as they were."""
    import torch
    from helpers import prepare

    from lightning_repro._lightning.prepared import unwrap

    cfg = base_cfg(data, "wds_det", 2, batched=True, webloader=True)
    user = streaming_pipelines.train_loader(cfg, 0, 1)
    users_loader, users_dataset = user.pipeline[0], user.pipeline[0].dataset
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        taken = prepare(user)
    assert type(taken) is type(user)
    assert taken is not user
    inner = unwrap(taken)
    assert inner is taken.pipeline[0]
    assert inner is not users_loader
    assert type(inner.dataset).__name__ == "KeyedIterable"
    assert inner.dataset.dataset is users_dataset
    assert user.pipeline == [users_loader]
    assert users_loader.dataset is users_dataset
    assert unwrap(user) is user
    assert unwrap(users_loader) is users_loader
    first = [batch["x"] for batch in taken]
    torch.manual_seed(123)
    again = [batch["x"] for batch in prepare(streaming_pipelines.train_loader(cfg, 0, 1))]
    assert len(first) == 10
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_a_checkpoint_where_a_new_pass_of_the_epoch_began_resumes_that_pass(runs: Any, data: str) -> None:
    """Epochs of 15 batches cut across passes of 10 (``with_epoch``): the checkpoint after batch 10 is written when
    the epoch's second pass has begun (Lightning fetched its first batch) and none of it was read. Its record once
    held no position ("its epoch starts over", NOT exact); it holds that pass now, and the resume is exact."""
    cfg = {**base_cfg(data, "wds_det", 2, batched=True, webloader=True, with_epoch=15), "ckpt_every_n_steps": 5}
    reference, _, resumed, _ = runs.resumed_in_place({**cfg, "save_last": True}, kill_after=11, at=(10, 10))
    assert (resumed["params"], resumed["optimizer"]) == (reference["params"], reference["optimizer"])
    line = resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line
    assert "pass 1 of the epoch from its start" in line, line


def test_a_webloaders_stages_draw_on_their_own_streams_and_leave_the_users_objects(data: str) -> None:
    """Stages after the loader (run in the main process) pull each batch on streams of its own: the batches are the
    same whatever the process streams were, iterating leaves those streams where they were, and the user's
    ``WebLoader`` keeps its class and stages."""
    import torch
    from helpers import prepare

    cfg = base_cfg(data, "wds_det", 0, batched=True, webloader=True, rebatch="shuffle")
    user = streaming_pipelines.train_loader(cfg, 0, 1)
    stages = list(user.pipeline)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        taken = prepare(user)
    assert user.pipeline == stages
    assert type(user).__name__ == type(taken).__name__ == "WebLoader"
    assert type(taken) is not type(user)  # the copy's subclass pulls the batches through the stages (webloader.py)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # webdataset leaves its tar files to the garbage collector
        torch.manual_seed(7)
        before = torch.get_rng_state()
        first = [batch["x"] for batch in taken]
        assert torch.equal(torch.get_rng_state(), before)  # the map's draws did not move training's stream
        torch.manual_seed(123)
        again = [batch["x"] for batch in prepare(streaming_pipelines.train_loader(cfg, 0, 1))]
        gc.collect()
    assert len(first) == 10
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_a_webloader_that_cannot_be_resumed_is_left_and_said_not_exact(runs: Any, data: str) -> None:
    """What a resumed epoch cannot read again as the interrupted one did is not taken over: one warning says why,
    and the resume line says NOT exact (stages seeded from the clock)."""
    from helpers import prepare

    from lightning_repro import NotExactWarning

    webloader = {"batched": True, "webloader": True}
    cases = {
        r"its `.shuffle\(16\)` after the DataLoader seeds itself from the process id and the clock \(to repeat it, give"
        r" it a seed": {**webloader, "rebatch": "unseeded"},
        r"its `.shuffle\(n, rng=...\)` after the DataLoader draws from a generator that goes on from epoch to epoch": {
            **webloader,
            "rebatch": "rng",
        },
    }
    for match, spec in cases.items():
        loader = streaming_pipelines.train_loader(base_cfg(data, "wds_det", 2, **spec), 0, 1)
        with pytest.warns(NotExactWarning, match=match):
            assert prepare(loader) is loader
    # detshuffle counts its passes in the main process's copy (workers 0): an epoch cut across passes and read again
    # from its first pass would take the counts of the pass it was interrupted in
    counting = {**webloader, "rebatch": "shuffle", "with_epoch": 15}
    for workers, persistent in ((0, False), (2, True)):
        cfg = {**base_cfg(data, "wds_det", workers, **counting), "persistent_workers": persistent}
        loader = streaming_pipelines.train_loader(cfg, 0, 1)
        with pytest.warns(NotExactWarning, match=r"across passes of a pipeline that counts its own passes"):
            assert prepare(loader) is loader
    repeated = streaming_pipelines.train_loader(base_cfg(data, "wds_det", 2, **webloader), 0, 1)
    with pytest.warns(NotExactWarning, match=r"it repeats the loader a number of times \(`repeat`\)"):
        assert prepare(repeated.repeat(2)) is repeated
    import torch
    import webdataset as wds

    mapped = wds.WebLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2).with_epoch(3)
    with pytest.warns(NotExactWarning, match=r"cut \(`with_epoch`\) from a loader over a map-style dataset"):
        assert prepare(mapped) is mapped
    staged = wds.WebLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2).unbatched().batched(4)
    with pytest.warns(NotExactWarning, match=r"its stages after the DataLoader run in the main process on a loader"):
        assert prepare(staged) is staged
    cfg = base_cfg(data, "wds_det", 2, **webloader, rebatch="unseeded")
    _, killed = runs.run({**cfg, **KILL}, "webloader-stages-killed", expect_kill=True)
    resumed, _ = runs.run({**cfg, "resume": str(runner.checkpoints(killed)[-1])}, "webloader-stages-resumed")
    line = resume_line(resumed["stderr"])
    assert ": NOT exact: " in line, line
    assert "a WebLoader is not a DataLoader lightning-repro takes over" in line, line


def test_webdatasets_resampling_without_deterministic_warns_at_takeover(data: str) -> None:
    """``WebDataset(urls, resampled=True)`` draws its shards from a generator seeded by the process id, the clock and
    ``os.urandom`` at every pass (two runs read other shards; it once said exact): one warning names it and how to
    make it deterministic; the deterministic pipeline gets none."""
    from helpers import prepare

    from lightning_repro import NotExactWarning

    with pytest.warns(NotExactWarning) as caught:
        prepare(streaming_pipelines.train_loader(base_cfg(data, "wds_resampled", 0), 0, 1))
    [message] = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
    assert "`ResampledShards` (webdataset) seeds itself from the process id and the clock" in message
    assert "`wds.ResampledShards(urls, deterministic=True)`" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare(streaming_pipelines.train_loader(base_cfg(data, "wds_resampled_det", 0), 0, 1))


def test_an_unseeded_webdataset_resume_says_not_exact(runs: Any, data: str) -> None:
    cfg = base_cfg(data, "wds_unseeded", 0)
    _, killed = runs.run({**cfg, **KILL}, "wds-unseeded-killed", expect_kill=True)
    resumed, _ = runs.run({**cfg, "resume": str(runner.checkpoints(killed)[-1])}, "wds-unseeded-resumed")
    line = resume_line(resumed["stderr"])
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
    cfg = {**base_cfg(data, "litdata_combined", 2), "ckpt_every_n_steps": 3, "ckpt_every_n_epochs": 1}
    cfg["persistent_workers"] = True
    ref, ref_out = runs.reference(cfg)
    killed = runs.run({**cfg, "kill_after_batches": 21}, "combined-killed", expect_kill=True)[1]
    by_step = {runner.checkpoint_position(f)[0]: f for f in runner.checkpoints(killed)}
    mid, end = by_step[12], by_step[20]
    assert runner.checkpoint_position(end)[::2] == (20, 0), "the test means to resume at the end of epoch 0"
    assert _replay_differs(mid), "the test means a state litdata's own replay deals out wrongly"
    resumed_mid, mid_out = runs.run({**cfg, "resume": str(mid)}, "combined-mid")
    line = resume_line(resumed_mid["stderr"])
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
    assert ": exact (restore verified:" in resume_line(resumed["stderr"])
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
    cfg = {**base_cfg(data, "litdata_parallel", 2), "persistent_workers": True}
    ref, _ = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    _, resumed = killed_and_resumed(runs, cfg, False)
    line = resume_line(resumed["stderr"])
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
    cfg = base_cfg(data, lib, 2)
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
    line = resume_line(resumed["stderr"])
    assert ": NOT exact: " in line, line
    assert goes_on in line, line
    epoch1 = [i for s in runner.steps(out) if s["epoch"] == 1 for i in s["indices"]]
    assert len(epoch1) == after, epoch1
    if lib == "litdata":  # the 8 items consumed before the checkpoint (steps 10 and 11) and the re-dealt ones
        epoch1 += [i for s in runner.steps(killed) if s["epoch"] == 1 and s["global_step"] < 12 for i in s["indices"]]
    assert sorted(epoch1) == list(range(40)), "an item of the epoch was missed or read twice"


@pytest.mark.parametrize(
    ("lib", "mode", "at"),
    [
        # litdata's loader does not resume a pass it read to its end: it would start its next pass at once, where the
        # uninterrupted run's shorter loader gave None (max_size) or cycled one fetch later (the keys of its next pass)
        pytest.param("litdata", "max_size", 8, id="litdata-run-out"),
        pytest.param("litdata", "max_size_cycle", 5, id="litdata-pass-end"),
        # HF's stream has no length: the epoch ends once each loader ran out, which the resumed run must know
        pytest.param("hf", "max_size_cycle", 8, id="hf-cycled"),
    ],
)
def test_two_loaders_of_a_library_resume_bitwise_after_the_shorter_ran_out(
    runs: Any, data: str, lib: str, mode: str, at: int
) -> None:
    """The pipeline twice in a ``CombinedLoader`` (batches of 4 and of 8: the second has half as many), 2 workers
    each, checkpointed every ``at`` steps, killed after 11 batches and resumed from step ``at``: after the shorter
    one ran out, or where its pass ended; litdata's pass-end case from step 10 too, the epoch's last batch (where
    Lightning restarts in the epoch and fetches once more: both litdata loaders started their next pass there and
    the resumed epoch trained one batch more, saying `exact`, then `NOT exact`)."""
    cfg = {**base_cfg(data, lib, 2, pair=mode), "two_loaders": True, "ckpt_every_n_steps": at}
    ref, ref_out = runs.reference(cfg)
    killed = runs.killed({**cfg, "kill_after_batches": 11})
    files = {runner.checkpoint_position(path)[0]: path for path in runner.checkpoints(killed)}
    for step in [at, *([10] if lib == "litdata" and 10 in files and at != 10 else [])]:
        resumed, out = runs.run({**cfg, "resume": str(files[step])}, f"resumed-two-{lib}-{mode}-{step}")
        assert "NotExactWarning" not in ref["stderr"] + resumed["stderr"], resumed["stderr"][-3000:]
        assert_same_run(ref, ref_out, [killed, out], resumed)  # every file, every row
        assert ": exact (restore verified:" in resume_line(resumed["stderr"])


def test_a_litdata_loader_beside_a_stream_without_length_resumes_bitwise(runs: Any, data: str) -> None:
    """HF's stream (batches of 4: 10) and litdata's loader (batches of 8: 5, cycled) in a ``CombinedLoader``: it has
    no length, so Lightning's fetcher holds a batch ahead of training, which litdata's own state counts as read. The
    state Lightning saved, loaded on resume, skipped a batch of litdata's (plain Lightning too), and the line said
    exact. Resumed from steps 3 and 6 (the second in litdata's second pass): every file, every row. From step 5 the
    batch held ahead is the first of litdata's next pass, whose state is not the consumed one's: said NOT exact (when
    the file is written, and by the resume line; step 15 of the runs above is such a step too)."""
    cfg = {**base_cfg(data, "hf", 2, pair="max_size_cycle", pair_with="litdata"), "two_loaders": True}
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 3})
    killed = runs.killed({**cfg, "ckpt_every_n_steps": 3, "kill_after_batches": 8})
    files = {runner.checkpoint_position(path)[0]: path for path in runner.checkpoints(killed)}
    for step in (3, 6):
        resumed, out = runs.run({**cfg, "ckpt_every_n_steps": 3, "resume": str(files[step])}, f"litdata-beside-{step}")
        assert_same_run(ref, ref_out, [killed, out], resumed)
        assert ": exact (restore verified:" in resume_line(resumed["stderr"])
    said, at_pass_start = runs.run({**cfg, "ckpt_every_n_steps": 5, "kill_after_batches": 7}, "k", expect_kill=True)
    assert "held the first batch of litdata's next pass ahead of training" in said["stderr"], said["stderr"][-3000:]
    [five] = [path for path in runner.checkpoints(at_pass_start) if runner.checkpoint_position(path)[0] == 5]
    resumed, _ = runs.run({**cfg, "ckpt_every_n_steps": 5, "resume": str(five)}, "litdata-beside-pass-start")
    line = resume_line(resumed["stderr"])
    assert ": NOT exact: the data position is not restored exactly" in line, line
    assert "the first batch of its next pass held ahead of training by Lightning" in line, line


# ------------------------------------------------------------------------------------------- num_workers 0 and 1
def test_litdata_with_0_and_1_workers_trains_alike_to_the_short_last_batch(runs: Any, data: str) -> None:
    """Batches of 3: each epoch ends with a batch of 1, collated after litdata's items ran out. With 0 workers that
    collate (litdata's own, keyed) once left the training's streams on its batch's stream, so the last step's
    dropout differed from the 1-worker run's (a resume 1 -> 0 said exact and differed there too)."""
    results = [runs.reference({**base_cfg(data, "litdata", w), "batch_size": 3}) for w in (0, 1)]
    (alone, alone_out), (worker, worker_out) = results
    assert rows(runner.steps(alone_out)) == rows(runner.steps(worker_out)), "a step differs"
    assert len(runner.steps(alone_out)) == 28
    assert (alone["params"], alone["optimizer"]) == (worker["params"], worker["optimizer"])


def test_hf_reads_another_order_with_one_worker_and_is_said_so(data: str) -> None:
    """HF gives a drawing stage (its shuffle buffer) a new generator in a worker, even the only one:
    ``main_reads_as_worker`` says which pipelines read the main process's order in worker 0, as torch's loaders with 0
    and 1 workers show (without lightning-repro)."""
    import torch
    from datasets import load_dataset

    from lightning_repro.data.libraries import main_reads_as_worker

    files = sorted(str(p) for p in (Path(data) / "json").glob("*.jsonl"))
    plain = load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch")
    shuffled = plain.shuffle(seed=streaming_pipelines.SEED, buffer_size=8)
    for ds, alike in ((shuffled, False), (plain, True)):
        loaders = [torch.utils.data.DataLoader(ds, batch_size=8, num_workers=w) for w in (0, 1)]
        orders = [[int(i) for batch in loader for i in batch["i"]] for loader in loaders]
        assert sorted(orders[0]) == sorted(orders[1]) == list(range(40))
        assert (orders[0] == orders[1]) is alike
        assert main_reads_as_worker(ds) is alike
    assert main_reads_as_worker(object())


def test_hf_resumed_from_1_worker_with_0_is_a_topology_change(runs: Any, data: str) -> None:
    """Checkpointed with one worker and resumed in the main process: said exact (0 and 1 read alike) while the
    resumed batches were another order's. A TopologyError now, with its reason."""
    cfg = base_cfg(data, "hf", 1)
    killed = runs.killed({**cfg, **KILL})
    moved = {**cfg, "num_workers": 0, "resume": str(runner.checkpoints(killed)[-1])}
    code, _, stderr = runner.execute([str(runner.SCENARIO), json.dumps({**moved, "out": runs.fresh_dir("hf-1-to-0")})])
    assert code != 0, stderr[-3000:]
    [error] = [line for line in stderr.splitlines() if line.startswith("lightning_repro.exceptions.TopologyError")]
    assert "was checkpointed with num_workers=1 and is resumed with num_workers=0" in error, error
    assert "reads another order in a worker (even the only one) than in the main process" in error, error
