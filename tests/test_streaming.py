"""Streaming data: an ``IterableDataset`` read by workers resumes exactly (issue 19, the core).

Each item a worker (or the main process) produces draws from the stream of (seed, rank, loader, epoch, pass,
worker, k); each batch comes stamped with its worker's position, and the checkpoint records every worker's consumed
items and batches (and the dataset's state taken in the worker). A run killed hard mid-epoch and resumed in a fresh
process must end bitwise like the uninterrupted run: weights, optimizer, every step's samples, loss and dropout
mask, the epoch values, and the checkpoint files. The pipeline is ``tests/scenario.py``'s ``ShardedStream``
(sharded by ``get_worker_info()`` and by rank, augmented from torch, numpy and python ``random``): 40 items, batch
4, 10 batches an epoch, two epochs.
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import helpers
import numpy as np
import pytest
import runner
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from lightning_repro import streams
from lightning_repro.checkpoint.entry import RankPart
from lightning_repro.data.epochstart import start_after_epoch_end
from lightning_repro.data.stamps import WorkerStamp
from lightning_repro.data.streaming import Ticket
from lightning_repro.data.workerpos import StreamPosition
from lightning_repro.exceptions import CorruptStateError
from lightning_repro.rng import capture_process_streams, digest_process_streams

BASE: dict[str, Any] = {"n": 40, "batch_size": 4, "max_epochs": 2, "val": "off"}
IGNORED = (  # as tests/test_accumulate_checkpoints.py: the checkout's state, and the seal over it
    "/callbacks/DeterminismCallback/manifest/code/",
    "/callbacks/DeterminismCallback/entry_sha256",
)


def _steps(out: str | Path) -> list[tuple[Any, ...]]:
    """Every step of a run's folder, the last record of a step winning (a resumed run appends to the killed one's)."""
    last = {(s["epoch"], s["batch_idx"]): s for s in runner.steps(out)}
    return [(k, s["indices"], s["loss"], s["dropout"]) for k, s in sorted(last.items())]


def _killed_then_resumed(runs: Any, cfg: dict[str, Any], kill: int) -> tuple[str, dict[str, Any]]:
    """``cfg`` killed hard after ``kill`` batches, resumed in a fresh process from its last checkpoint in the same
    folder (its checkpoint files go on there)."""
    _, out = runs.run({**cfg, "kill_after_batches": kill}, "stream-killed", expect_kill=True)
    last = runner.checkpoints(out)[-1]
    resumed = runner.run({**cfg, "out": out, "resume": str(last)})
    return out, resumed


# (stream options, workers, every_n_train_steps, kill after): where each checkpoint falls in the epoch
CASES = [
    # after 3 batches of epoch 1: the next batch is worker 1's, while torch starts every pass at worker 0; persistent
    # workers keep their copy of the dataset from the first epoch (the epoch's key comes with the batch requests), so
    # the module's set_epoch(1) does not reach them: they read epoch 1 in epoch 0's order, the resumed ones too
    pytest.param(
        {"sized": True, "persistent_workers": True, "set_epoch": True}, 2, 13, 16, id="persistent-set_epoch-turn-w1"
    ),
    # each worker's shard in an order drawn from get_worker_info().seed: persistent workers draw their base seed when
    # they start, at epoch 0 in the uninterrupted run, at epoch 1 in the resumed one (they read other orders)
    pytest.param(
        {"sized": True, "persistent_workers": True, "worker_seed": True},
        2,
        13,
        16,
        id="persistent-worker-seed",
        marks=pytest.mark.streaming,
    ),
    # its own state_dict(), taken in the worker; the module's set_epoch in on_train_epoch_start (not rerun)
    pytest.param({"state": True, "set_epoch": True}, 2, 13, 16, id="state-set_epoch"),
    # on epoch 0's last batch, no __len__ (the fetcher marks it), a validation after each epoch (without one,
    # such a resume logs one step lower after it, map-style data too: _batches_that_stepped, noted in the report)
    pytest.param({"val": "epoch"}, 2, 10, 12, id="unsized-epoch-last-batch"),
    # worker 1 (3 batches) is exhausted when the checkpoint is written, 7 batches into epoch 1, and it is its turn
    pytest.param({"unequal": True, "sized": True}, 2, 17, 19, id="unequal-worker1-exhausted"),
    pytest.param({}, 0, 13, 16, id="main-process"),
    # at the end of epoch 0 (ModelCheckpoint(every_n_epochs=1), no step checkpoints): on restart Lightning makes a
    # throwaway iterator of epoch 1 before the real one; the real one must read epoch 1's first pass, not a second;
    # and it makes that iterator before on_train_epoch_start, where the module calls set_epoch(1): its workers start
    # again on the dataset given its epoch
    pytest.param({"ckpt_every_n_epochs": 1, "set_epoch": True, "sized": True}, 2, 0, 12, id="epoch-end-set_epoch"),
    # the same without __len__: Lightning fetches epoch 1's first batch there, before the hook, so the dataset is
    # given the epoch the hook gives (predicted: an epoch-0 checkpoint cannot show it), and given its own back
    # before the hook, which is then checked; in the main process too (the first batch read there then)
    pytest.param(  # in the marked run of scripts/test.sh (the main suite's time)
        {"ckpt_every_n_epochs": 1, "set_epoch": True},
        2,
        0,
        12,
        id="epoch-end-set_epoch-unsized",
        marks=pytest.mark.streaming,
    ),
    pytest.param({"ckpt_every_n_epochs": 1, "set_epoch": True}, 0, 0, 12, id="epoch-end-set_epoch-unsized-w0"),
    # persistent workers' copies keep epoch 0 (the record's), but the record of epoch 1 says the dataset's epoch then
    pytest.param(
        {"ckpt_every_n_epochs": 1, "set_epoch": True, "sized": True, "persistent_workers": True},
        2,
        0,
        12,
        id="epoch-end-set_epoch-persistent",
        marks=pytest.mark.streaming,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("stream", "workers", "every", "kill"), CASES)
def test_a_killed_stream_resumes_bitwise(
    runs: Any, stream: dict[str, Any], workers: int, every: int, kill: int
) -> None:
    options = {k: v for k, v in stream.items() if k in ("state", "sized", "unequal", "set_epoch", "worker_seed")}
    cfg = {**BASE, **{k: v for k, v in stream.items() if k not in options}, "stream": options, "num_workers": workers}
    cfg["ckpt_every_n_steps"] = every
    reference, ref_out = runs.reference(cfg)
    out, resumed = _killed_then_resumed(runs, cfg, kill)
    for key in ("params", "optimizer", "global_step", "epoch", "metrics"):
        assert resumed[key] == reference[key], key
    assert _steps(out) == _steps(ref_out)
    assert runner.epochs(out) == runner.epochs(ref_out)
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)
    if options.get("set_epoch"):  # the module's set_epoch(1) reaches the workers' copies unless they persist
        [record] = [r for r in map(runner.stream_record, runner.checkpoints(out)) if r["epoch"] == 1][:1]
        want = 0 if stream.get("persistent_workers") else 1
        assert (record["epoch"], record["dataset_epoch"], record["workers_epoch"]) == (1, 1, want), record
    [line] = [x for x in resumed["stderr"].splitlines() if x.startswith("lightning-repro: resumed from")]
    assert ": exact (" in line, line
    if every not in (0, 10):  # mid-epoch: the line says where each worker stood
        assert ("worker positions restored: w0" if workers else "position restored at 12 items") in line, line
    if every == 0 and options.get("set_epoch") and not stream.get("persistent_workers"):  # the epoch read, and why
        read = "its first batch read before" if not options.get("sized") else "its workers started"
        assert f"a new pass after the epoch-end checkpoint, {read}" in line, line
        assert "with set_epoch(1), predicted for that hook (an epoch-0 checkpoint cannot show it)" in line, line
    assert "Warning" not in resumed["stderr"].replace("PossibleUserWarning", "")


@pytest.mark.slow
@pytest.mark.parametrize("sized", [True, False], ids=["sized", "unsized"])
def test_an_epoch_given_before_on_train_epoch_start_is_checked(runs: Any, sized: bool) -> None:
    """An epoch-0 checkpoint cannot show whether the hook gives the dataset its epoch: it is given set_epoch(1) before
    epoch 1's first iterator, then its own back before the hook, and what the hook left is checked. Here nothing
    gives it (it shuffles by its epoch, always 0): with ``__len__`` the workers start again on epoch 0 before the
    first batch (exact); without, Lightning fetched that batch before the hook: a ``NotExactWarning`` says so."""
    stream = {"set_epoch": "never", **({"sized": True} if sized else {})}
    cfg = {**BASE, "stream": stream, "num_workers": 2, "ckpt_every_n_epochs": 1}
    out, resumed = _killed_then_resumed(runs, cfg, 12)
    [line] = [x for x in resumed["stderr"].splitlines() if x.startswith("lightning-repro: resumed from")]
    assert "with set_epoch(1), predicted for that hook (an epoch-0 checkpoint cannot show it)" in line, line
    if not sized:
        assert "its first batch read before on_train_epoch_start" in line, line
        said = "The IterableDataset shows epoch 0 after on_train_epoch_start, but this epoch's first batch was read"
        assert f"{said} with epoch 1" in resumed["stderr"], resumed["stderr"][-3000:]
        assert "is NOT the uninterrupted run's" in resumed["stderr"]
        return
    reference, ref_out = runs.reference(cfg)
    assert (resumed["params"], resumed["optimizer"]) == (reference["params"], reference["optimizer"])
    assert _steps(out) == _steps(ref_out)
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)
    assert "Warning" not in resumed["stderr"].replace("PossibleUserWarning", "")


@pytest.mark.slow
def test_a_checkpoint_records_each_workers_consumed_position(runs: Any) -> None:
    """Worker 1 drops out of the turn early: the entry counts the batches training ran, per worker, not prefetched."""
    cfg = {**BASE, "stream": {"unequal": True, "sized": True, "state": True}, "num_workers": 2}
    _, out = runs.run({**cfg, "ckpt_every_n_steps": 7, "kill_after_batches": 9}, "stream-record", expect_kill=True)
    [path] = runner.checkpoints(out)
    entry = torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]
    [record] = entry["ranks"][0]["streaming"].values()
    # 7 batches of epoch 0: w0 w1 w0 w1 w0 w1 w0 (worker 1 has 12 items, 3 batches), then only worker 0
    assert (record["epoch"], record["batches"], record["turn"], record["num_workers"]) == (0, 7, 1, 2)
    assert [(w["worker"], w["items"], w["batches"], w["state"]) for w in record["workers"]] == [
        (0, 16, 4, {"pos": 16}),
        (1, 12, 3, {"pos": 12}),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.streaming)])
def test_a_fit_saved_after_it_ended_continues_for_more_epochs(runs: Any, tmp_path: Path, workers: int) -> None:
    """``trainer.save_checkpoint`` after ``fit`` ran its 2 epochs, then ``fit(ckpt_path=...)`` with ``max_epochs=3``:
    epoch 2 reads its whole pass, as in an uninterrupted 3-epoch run (not a fast-forward of the last pass's items)."""
    cfg = {**BASE, "stream": {}, "num_workers": workers}
    reference, ref_out = runs.reference({**cfg, "max_epochs": 3})
    saved = str(tmp_path / "end.ckpt")
    _, out = runs.run({**cfg, "save_at_end": saved}, "stream-fit-ended")
    resumed = runner.run({**cfg, "max_epochs": 3, "out": out, "resume": saved})
    for key in ("params", "optimizer", "global_step", "epoch"):
        assert resumed[key] == reference[key], key
    assert _steps(out) == _steps(ref_out)
    [line] = [x for x in resumed["stderr"].splitlines() if x.startswith("lightning-repro: resumed from")]
    assert ": exact (" in line, line
    assert "fast-forward" not in line, line


@pytest.mark.slow
def test_another_num_workers_is_refused_or_reseeded(runs: Any) -> None:
    cfg = {**BASE, "stream": {}, "num_workers": 2, "ckpt_every_n_steps": 13}
    _, out = runs.run({**cfg, "kill_after_batches": 14}, "stream-topology", expect_kill=True)
    last = str(runner.checkpoints(out)[-1])
    code, _, stderr = runner.execute(
        [str(runner.SCENARIO), json.dumps({**cfg, "num_workers": 0, "resume": last, "out": f"{out}-w0"})]
    )
    assert code != 0
    assert "TopologyError: train dataloader 0 over the IterableDataset _NoState was checkpointed with" in stderr
    assert "num_workers=2 and is resumed with num_workers=0" in stderr
    assert "Resume with num_workers=2 (exact), or pass `on_topology_change='reseed'` to DeterminismCallback" in stderr
    assert "then the epoch's data starts over on the new workers" in stderr
    reseeded = {**cfg, "num_workers": 0, "resume": last, "on_topology_change": "reseed"}
    first = runner.run({**reseeded, "out": f"{out}-reseed-a"})
    assert "NOT exact" in first["stderr"]
    assert "the epoch's data starts over on the new workers" in first["stderr"]
    assert "data: _NoState: the epoch's data starts over on the main process" in first["stderr"]
    assert runner.run({**reseeded, "out": f"{out}-reseed-b"})["params"] == first["params"]  # deterministic


@pytest.mark.slow
def test_one_worker_reads_the_main_processs_items(runs: Any) -> None:
    """num_workers 0 and 1 key their items alike (worker 0): a checkpoint of one resumes exactly on the other."""
    cfg = {**BASE, "stream": {}, "num_workers": 0, "ckpt_every_n_steps": 13}
    reference, _ = runs.reference(cfg)
    assert runs.reference({**cfg, "num_workers": 1})[0]["params"] == reference["params"]
    _, out = runs.run({**cfg, "kill_after_batches": 14}, "stream-w0-killed", expect_kill=True)
    resumed = runner.run({**cfg, "num_workers": 1, "resume": str(runner.checkpoints(out)[-1]), "out": f"{out}-w1"})
    assert resumed["params"] == reference["params"]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.streaming  # the marked run of scripts/test.sh: a 2-rank job with 2 workers a rank, ~1 min
def test_a_killed_ddp_job_resumes_each_ranks_workers(runs: Any) -> None:
    """2 ranks, 2 workers each: the stream splits by rank (torch.distributed) and then by worker (6 batches/epoch)."""
    cfg = {**BASE, "stream": {}, "num_workers": 2, "mp_context": "forkserver", "ckpt_every_n_steps": 9}
    reference, ref_out = runs.ddp_reference(cfg, "nodes")  # two warm nodes: rank 1 imports nothing afresh
    _, killed = runs.ddp_reference({**cfg, "kill_after_batches": 11}, "nodes", expect_kill=True)
    last = str(runner.checkpoints(killed)[-1])
    resumed, out = runs.ddp({**cfg, "resume": last}, "stream-ddp-resumed", launcher="nodes")
    assert resumed["params"] == reference["params"]
    assert resumed["optimizer"] == reference["optimizer"]
    for rank in (0, 1):
        got = [(s["epoch"], s["batch_idx"], s["indices"], s["loss"]) for s in runner.stitched(killed, out, rank)]
        want = [(s["epoch"], s["batch_idx"], s["indices"], s["loss"]) for s in runner.steps(ref_out, rank)]
        assert got == want, f"rank {rank}"


# ---------------------------------------------------------------------------------------- torchdata
TORCHDATA = [
    # its own state in the worker, and the loader saving its own state too (Lightning saves and loads it)
    pytest.param({"stream": {"state": True, "sized": True}}, 2, id="iterable-state-workers2"),
    pytest.param({"stream": {"state": True}}, 0, id="iterable-state-main-process"),
    # map-style data: our sampler (exact already), the loader's own state beside it
    pytest.param({}, 2, id="map-style-workers2"),
]


@pytest.mark.slow
@pytest.mark.streaming
@pytest.mark.parametrize(("data", "workers"), TORCHDATA)
def test_a_killed_stateful_dataloader_resumes_bitwise(runs: Any, data: dict[str, Any], workers: int) -> None:
    cfg = {**BASE, **data, "stateful_loader": True, "num_workers": workers, "ckpt_every_n_steps": 5}
    reference, ref_out = runs.reference(cfg)
    out, resumed = _killed_then_resumed(runs, cfg, 16)
    for key in ("params", "optimizer", "global_step", "epoch", "metrics"):
        assert resumed[key] == reference[key], key
    assert _steps(out) == _steps(ref_out)
    problems = runner.compare_checkpoint_files(ref_out, out, ignore=IGNORED)
    assert not problems, "\n".join(problems)
    [line] = [x for x in resumed["stderr"].splitlines() if x.startswith("lightning-repro: resumed from")]
    assert ": exact (" in line, line


# ---------------------------------------------------------------------------------------- in process
class Draws(IterableDataset):  # type: ignore[type-arg]
    """Each worker's shard of 12 items, each drawing from torch, numpy and python."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        ids = range(12) if info is None else range(info.id, 12, info.num_workers)
        for i in ids:
            yield torch.tensor([float(i), float(torch.rand(())), float(np.random.rand()), random.random()])


def _take(loader: DataLoader[Any]) -> list[list[float]]:
    import helpers

    prepared = helpers.prepare(loader)
    return [row for batch in prepared for row in batch.tolist()]


def test_items_draw_the_same_whatever_the_prefetch_and_the_main_process_streams() -> None:
    first = _take(DataLoader(Draws(), batch_size=2, num_workers=2))
    torch.manual_seed(123)  # the main process's streams do not reach the workers' items
    assert _take(DataLoader(Draws(), batch_size=2, num_workers=2, prefetch_factor=1)) == first
    assert sorted(row[0] for row in first) == list(range(12))
    assert _take(DataLoader(Draws(), batch_size=3, num_workers=1)) == _take(DataLoader(Draws(), batch_size=3))


class _OwnDrawsIterator:
    """An iterator that makes its own generator at each pass, unseeded (as litdata's ``ParallelStreamingDataset``
    gives its transform generators seeded from the items read so far: other ones in a resumed pass)."""

    def __init__(self, ids: range) -> None:
        self.ids = iter(ids)
        self.rng = np.random.default_rng()  # from the OS: another sequence at every pass

    def __next__(self) -> torch.Tensor:
        return torch.tensor([float(next(self.ids)), float(self.rng.random())])


class IteratorDraws(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> _OwnDrawsIterator:
        info = get_worker_info()
        return _OwnDrawsIterator(range(8) if info is None else range(info.id, 8, info.num_workers))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_generator_the_iterator_makes_at_each_pass_is_keyed_per_item(workers: int) -> None:
    first = _take(DataLoader(IteratorDraws(), batch_size=2, num_workers=workers))
    assert _take(DataLoader(IteratorDraws(), batch_size=2, num_workers=workers)) == first
    assert sorted(row[0] for row in first) == list(range(8))
    assert len({row[1] for row in first}) == 8
    plain = [row for batch in DataLoader(IteratorDraws(), batch_size=2) for row in batch.tolist()]
    assert plain != [row for batch in DataLoader(IteratorDraws(), batch_size=2) for row in batch.tolist()]


class BatchedDraws(IterableDataset):  # type: ignore[type-arg]
    """:class:`Draws` batched by the dataset itself (for a loader with ``batch_size=None``), 2 items a batch."""

    def __iter__(self) -> Any:
        rows = list(Draws())
        for k in range(0, len(rows), 2):
            yield torch.stack(rows[k : k + 2])


def test_persistent_workers_without_batch_requests_read_each_pass_on_its_own_streams() -> None:
    """``batch_size=None``: torch's fetcher reads no index a worker could learn its pass from, and a persistent
    worker keeps the copy of its first pass: each pass's key reaches it through shared memory (``data/passkey.py``).
    Persistent workers then read every epoch as workers started at each pass do."""

    def epochs(persistent: bool) -> list[list[list[float]]]:
        counter = helpers.Counter()
        loader = DataLoader(BatchedDraws(), batch_size=None, num_workers=2, persistent_workers=persistent)
        prepared = helpers.prepare(loader, counter)
        passes = []
        for epoch in range(3):
            counter.value = epoch
            passes.append([row for batch in prepared for row in batch.tolist()])
        return passes

    persistent = epochs(True)
    assert persistent == epochs(False)
    assert all(sorted(row[0] for row in rows) == list(range(12)) for rows in persistent)
    assert persistent[0] != persistent[1] != persistent[2], "each epoch's items draw from that epoch's streams"


class WorkerSeeds(Dataset):  # type: ignore[type-arg]
    """Each item: the seed torch gave the worker that loads it (``get_worker_info().seed``, base seed + id)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(get_worker_info().seed)


class IterableWorkerSeeds(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        yield from (torch.tensor(get_worker_info().seed) for _ in range(4))


@pytest.mark.parametrize("dataset", [WorkerSeeds, IterableWorkerSeeds], ids=["map-style", "iterable"])
def test_persistent_workers_started_by_a_resumed_run_get_the_base_seed_the_interrupted_runs_had(dataset: Any) -> None:
    """Persistent workers draw their base seed once, when they start: at epoch 0 in the uninterrupted run, at the
    resumed epoch after a resume. Anything made from it in a worker (a shard order from ``get_worker_info().seed``,
    what a ``worker_init_fn`` draws) differed after a resume, which said exact (``streams.loader_seed``)."""

    def seeds_in_epoch_1(first_epoch: int, persistent: bool) -> list[int]:
        counter = helpers.Counter(first_epoch)
        loader = DataLoader(dataset(), batch_size=2, num_workers=2, persistent_workers=persistent)
        prepared = helpers.prepare(loader, counter)
        for epoch in range(first_epoch, 2):
            counter.value = epoch
            seeds = sorted({int(seed) for batch in prepared for seed in batch})
        return seeds

    assert seeds_in_epoch_1(1, persistent=True) == seeds_in_epoch_1(0, persistent=True)
    assert seeds_in_epoch_1(1, persistent=False) == seeds_in_epoch_1(0, persistent=False)  # each pass its own
    assert seeds_in_epoch_1(0, persistent=False) != seeds_in_epoch_1(0, persistent=True)
    assert len(seeds_in_epoch_1(0, persistent=True)) == 2  # one per worker


def test_loading_in_the_main_process_leaves_its_streams_as_found() -> None:
    before = digest_process_streams(capture_process_streams())
    rows = _take(DataLoader(Draws(), batch_size=4))
    assert digest_process_streams(capture_process_streams()) == before
    assert len({row[1] for row in rows}) == 12  # each item drew from its own stream
    list(DataLoader(Draws(), batch_size=4))
    assert digest_process_streams(capture_process_streams()) != before  # the control: plain loading does


def test_item_keys_do_not_collide_across_workers_items_and_passes() -> None:
    base = streams.iterable_seed(7, 0, streams.StreamKey("train", 0), 1, 0)
    seeds = {streams.item_seed(streams.worker_items_seed(base, w), k) for w in range(8) for k in range(500)}
    assert len(seeds) == 8 * 500
    assert base != streams.iterable_seed(7, 0, streams.StreamKey("train", 0), 1, 1)
    assert base != streams.iterable_seed(7, 1, streams.StreamKey("train", 0), 1, 0)


def test_a_position_counts_only_the_batches_training_consumed() -> None:
    consumed = [0]
    position = StreamPosition(num_workers=2, consumed=lambda: consumed[0])
    position.begin_pass(0, 0, dataset_epoch=None, start=None)
    for n, worker in enumerate([0, 1, 0, 1]):  # produced ahead of training
        position.produced(WorkerStamp(None, worker, 4 * (n // 2 + 1), n // 2 + 1))
    consumed[0] = 3
    record = position.describe(3)
    assert record is not None
    assert (record["batches"], record["turn"]) == (3, 1)
    assert [(w["worker"], w["items"], w["batches"]) for w in record["workers"]] == [(0, 8, 2), (1, 4, 1)]
    assert position.describe(4)["workers"][1]["items"] == 8  # type: ignore[index]


class _Epoched:
    def __init__(self) -> None:
        self.epoch = 0
        self.given: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.given.append(epoch)


def test_an_epoch_end_start_gives_the_hooks_epoch_then_the_datasets_own_back() -> None:
    """What the first pass after an epoch-end checkpoint gives the dataset, and when it stops giving it."""
    dataset = _Epoched()
    start = start_after_epoch_end(dataset, 1, {"epoch": 0, "dataset_epoch": 0}, None)
    assert (start.epoch, start.before, start.evidence, dataset.epoch) == (1, 0, "predicted", 1)
    assert start_after_epoch_end(dataset, 1, {"epoch": 0, "dataset_epoch": 0}, start) is start  # the dropped one's
    assert (start.waiting(), dataset.given) == (True, [1])
    start.settle(hook_runs=True)  # before on_train_epoch_start: its own epoch back, the hook's checked after it
    assert (dataset.epoch, start.checked, start.waiting()) == (0, True, False)
    start_after_epoch_end(dataset, 1, {"epoch": 0, "dataset_epoch": 0}, start)  # a pass made again: the hook decides
    assert dataset.given == [1, 0]
    kept = start_after_epoch_end(_Epoched(), 1, {"epoch": 0, "dataset_epoch": 0}, None)
    kept.settle(hook_runs=False)  # Lightning will not run the hook: the given epoch stays, unchecked
    assert (kept.dataset.epoch, kept.checked) == (1, False)
    seen = start_after_epoch_end(_Epoched(), 2, {"epoch": 1, "dataset_epoch": 1}, None)
    assert (seen.epoch, seen.evidence) == (2, "each epoch")
    other = start_after_epoch_end(_Epoched(), 2, {"epoch": 1, "dataset_epoch": 0}, None)  # not given each epoch
    assert (other.epoch, other.dataset.given) == (None, [])


def test_a_ticket_carries_its_key_to_a_worker() -> None:
    ticket = pickle.loads(pickle.dumps(Ticket([None, None], 99, ("train", 0, 0))))
    assert (list(ticket), ticket.key, ticket.owner) == ([None, None], 99, ("train", 0, 0))


def test_an_entrys_worker_positions_are_optional_and_checked() -> None:
    live = capture_process_streams()
    good: dict[str, Any] = {"epoch": 1, "pass": 0, "batches": 3, "consumed": 3, "turn": 1, "num_workers": 2}
    good.update(dataset_epoch=None, workers=[{"worker": 0, "items": 8, "batches": 2, "state": {"pos": 8}}])

    def part(**streaming: Any) -> dict[str, Any]:
        return RankPart(live, digest_process_streams(live), 3, [], streaming=streaming).to_dict()

    assert "streaming" not in part()  # optional: an entry without it (written before) reads as before
    assert RankPart.from_dict(part()).streaming == {}
    assert RankPart.from_dict(part(**{"0": good})).streaming == {"0": good}
    counted = {**good, "stage_epochs": [0, 3]}  # webdataset's detshuffle counts (data/libraries.py)
    assert RankPart.from_dict(part(**{"0": counted})).streaming == {"0": counted}
    workers = {**good, "workers": [{"worker": 0, "items": "8", "batches": 2}]}
    for bad in ({**good, "turn": -1}, workers, [good], {**good, "stage_epochs": ["0"]}, {**good, "stage_epochs": 1}):
        with pytest.raises(CorruptStateError, match="'streaming' holds a malformed worker position"):
            RankPart.from_dict(part(**{"0": bad}))


class Consumed(IterableDataset):  # type: ignore[type-arg]
    """Items taken from a shared source (a queue, a socket): what one iterator reads no other gets."""

    def __init__(self, source: list[int]) -> None:
        self.source = source

    def __iter__(self) -> Any:
        for _ in range(4):
            yield torch.full((32,), float(self.source.pop(0)))


@pytest.mark.skipif(
    not helpers.LIGHTNING_26,
    reason="Lightning 2.5 makes the extra iterator itself (fixed in 2.6: its test_double_iter_in_iterable_dataset.py)",
)
def test_an_epoch_end_resume_makes_no_extra_iterator(tmp_path: Path) -> None:
    """Saved after ``fit`` (its epochs all done), resumed for more epochs: the iterator Lightning makes for the next
    epoch is the one it trains on, as in plain Lightning; an extra one would take items from a consuming source
    (Lightning's own ``test_double_iter_in_iterable_dataset.py`` failed so with the callback injected)."""
    import helpers
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_repro import DeterminismCallback

    source = list(range(16))
    path = tmp_path / "end.ckpt"
    for epochs, ckpt in ((2, None), (4, path)):
        trainer = helpers.fast_trainer([DeterminismCallback(seed=0)], max_epochs=epochs, default_root_dir=tmp_path)
        trainer.fit(BoringModel(), DataLoader(Consumed(source), batch_size=None), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(path)
    assert source == []  # every item trained once: 4 epochs of 4
    assert trainer.global_step == 16


def test_a_stateful_loaders_snapshot_gets_the_saved_entry_of_each_worker_that_sent_nothing_since_the_resume() -> None:
    """``data/loaderstate.py``: the saved entry of each worker not yet heard from in the resumed pass; a worker that
    sent a batch keeps its own; an older snapshot (taken before the last batch) or another layout is left alone."""
    from lightning_repro.data.loaderstate import _saved_entries_of_silent_workers as fill

    def state(w0: Any, w1: Any, since: int = 0) -> dict[str, Any]:
        return {"_snapshot": {"_snapshot_step": 3, "_worker_snapshots": {"worker_0": w0, "worker_1": w1}},
                "_steps_since_snapshot": since}  # fmt: skip

    saved, fresh = state({"n": 4}, {"n": 5}), state({"n": 6}, {"n": 0})
    filled = fill(fresh, saved, {0})
    assert filled["_snapshot"]["_worker_snapshots"] == {"worker_0": {"n": 6}, "worker_1": {"n": 5}}
    assert filled["_snapshot"]["_snapshot_step"] == 3
    assert fresh["_snapshot"]["_worker_snapshots"]["worker_1"] == {"n": 0}  # a copy: the loader's own is untouched
    assert fill(fresh, saved, {0, 1}) is fresh  # every worker heard from
    stale = state({"n": 6}, {"n": 0}, since=1)
    assert fill(stale, saved, {0}) is stale  # the snapshot may predate a batch `yielded` counts
    assert fill({"dataset_state": 1}, saved, set()) == {"dataset_state": 1}  # no workers (num_workers=0)
