"""torchdata's ``torchdata.nodes`` pipelines (``Loader`` over ``SamplerWrapper``, ``ParallelMapper``, ``Batcher``,
``Prefetcher``), as its docs' migration from ``DataLoader`` writes them (``tests/streaming_pipelines.py: _nodes``):
killed and resumed in fresh processes, and taken over in process."""

from __future__ import annotations

import functools
import gc
import hashlib
import random
import time
from pathlib import Path
from typing import Any

import pytest
import runner
import streaming_pipelines
import torch
from streaming_cases import assert_same_run, base_cfg, killed_and_resumed, resume_line

from lightning_repro.data import nodes, nodethreads
from lightning_repro.streams import StreamKey

tn = pytest.importorskip("torchdata.nodes", reason="torchdata is in the test lock (requirements/lock.txt)")


@pytest.fixture(autouse=True)
def _collect_garbage_in_this_thread() -> Any:
    """A loader iterated here is cyclic garbage once a test drops it (``Loader._it.loader`` is the loader), and its
    mapper's threads end a moment after its pass: a garbage collection triggered by an exiting sort thread ran
    torchdata's ``_ParallelMapperIter.__del__`` in that thread, whose join of itself raises "cannot join current
    thread" (an unraisable error, which pytest fails the test on; seen once, the main suite beside another job). The
    cyclic collector is off during each test and runs in this thread after it."""
    gc.disable()
    try:
        yield
    finally:
        gc.collect()  # here: torchdata's __del__ joins the threads that are still ending
        gc.enable()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("nodes-data"))  # the pipeline's data is made in memory (MapItems)


_PATH = "torchdata.nodes Loader: its own state after the 2 consumed batches, loaded by Lightning, its draws keyed"


@pytest.mark.slow  # fresh processes: the main suite's (not the fast tests of test-min/test-new)
@pytest.mark.parametrize(
    ("workers", "spec", "twice"),
    [
        # the dataset's __getitem__ (augmentation from torch and python) in 2 worker processes, a Prefetcher's thread
        # above them; killed again after the resume and resumed from a file the resumed run wrote
        pytest.param(2, {}, True, id="process-2-prefetched-twice"),
        # the Mapper in the main process (no Prefetcher, whose thread would run it: not exact, warned), a node of the
        # user's own class over the batches, which says it draws nothing, and the order from an IterableWrapper whose
        # iterable draws it (pulled in the main thread: keyed)
        pytest.param(0, {"prefetch": False, "custom": True, "iterable": True}, False, id="inline-custom-iterable"),
    ],
)
def test_killed_mid_epoch_resumes_bitwise(
    runs: Any, data: str, workers: int, spec: dict[str, Any], twice: bool
) -> None:
    cfg = base_cfg(data, "nodes", workers, **spec)
    ref, ref_out = runs.reference({**cfg, "ckpt_every_n_steps": 6})
    outs, resumed = killed_and_resumed(runs, cfg, twice=twice)
    assert_same_run(ref, ref_out, outs, resumed)  # every checkpoint file (the loader's own state too), every row
    line = resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line
    assert (_PATH.replace("2 consumed", "8 consumed") if twice else _PATH) in line, line


@pytest.mark.slow  # fresh processes: the main suite's (not the fast tests of test-min/test-new)
def test_a_mixture_killed_after_a_source_restarted_resumes_bitwise(runs: Any, data: str) -> None:
    """A ``MultiNodeWeightedSampler`` over two sources, each mapped by 2 process workers, under a ``Prefetcher``: the
    small source runs out and restarts (in the Prefetcher's thread) before the checkpoint at step 8, so the resumed
    process must draw that restarted pass's order again (keyed by the pass count torchdata keeps in its state).
    Resumed with 1 worker per source: torchdata's state and our keys do not depend on the number of workers.
    Validated every 5 batches on a mixture loader of its own (its state is not saved: its passes and its mixture are
    keyed by the validation's counter, not by how many passes the process ran)."""
    # no Prefetcher: a restart in its thread forks the new workers from a thread (a forked worker died once, hanging)
    cfg = {**base_cfg(data, "nodes", 2, mix=True, val_nodes=True, prefetch=False), "ckpt_every_n_steps": 4, "val": 5}
    ref, ref_out = runs.reference(cfg)
    before = [i for step in runner.steps(ref_out)[:8] for i in step["indices"]]
    assert sum(i >= 30 for i in before) > 10, "the small source (10 items) is meant to restart before step 8"
    killed = runs.killed({**cfg, "kill_after_batches": 10})
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[:2] == (8, 8), "the test means to resume from epoch 0's 8th batch"
    resumed, out = runs.run({**cfg, "num_workers": 1, "resume": str(last)}, "resumed-mixture-1-worker")
    assert_same_run(ref, ref_out, [killed, out], resumed)
    line = resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line
    assert _PATH.replace("2 consumed", "8 consumed") in line, line


@pytest.mark.slow  # fresh processes: the main suite's (not the fast tests of test-min/test-new)
@pytest.mark.parametrize("mode", ["max_size_cycle", "max_size"])
def test_a_loader_cycled_or_run_out_beside_a_longer_one_resumes_bitwise(runs: Any, data: str, mode: str) -> None:
    """Two Loaders in a ``CombinedLoader``: the second (4 batches) beside the first (10 a pass), cycled in its epoch
    (``max_size_cycle``: its passes end at batches 4 and 8, where Lightning starts the next at once) or run out after
    4 (``max_size``: ``None`` for the rest of the epoch); killed after 10 batches and resumed with 1 worker from step
    9 and from step 8, where a pass ended. Neither loader has a length: the epoch ends when the first runs out, the
    second having run out before (Lightning's flags, not in its checkpoint: given back from our entry, else the
    resumed epoch read the first loader again). Before, the second loader's state was looked up by the epoch's batch
    count in its own pass (none kept: warned, and its own state, a batch ahead, saved)."""
    cfg = {**base_cfg(data, "nodes", 2, two=mode, prefetch=False), "two_loaders": True, "ckpt_every_n_steps": 1}
    ref, ref_out = runs.reference(cfg)
    assert "NotExactWarning" not in ref["stderr"], ref["stderr"][-3000:]
    second = [step["indices"][1] for step in runner.steps(ref_out)[:10]]
    assert (sum(i is None for i in second) == 6) == (mode == "max_size"), "the second loader is meant to run out"
    killed = runs.killed({**cfg, "kill_after_batches": 10})
    files = {runner.checkpoint_position(path)[0]: path for path in runner.checkpoints(killed)}
    for step in (9, 8) if mode == "max_size_cycle" else (9,):
        resumed, out = runs.run({**cfg, "num_workers": 1, "resume": str(files[step])}, f"resumed-two-{mode}-{step}")
        assert_same_run(ref, ref_out, [killed, out], resumed)  # every file (both loaders' own states), every row
        line = resume_line(resumed["stderr"])
        assert ": exact (restore verified:" in line, line
        assert line.count(_PATH.replace("2 consumed", f"{step} consumed")) == 2, line


@pytest.mark.slow  # fresh processes: the main suite's (not the fast tests of test-min/test-new)
def test_an_epoch_end_checkpoint_resumes_a_new_pass_bitwise(runs: Any, data: str) -> None:
    """The checkpoint on epoch 0's last batch (step 10 of 10): the loader's state is of a pass read to its end."""
    cfg = {**base_cfg(data, "nodes", 2), "ckpt_every_n_steps": 5}
    ref, ref_out = runs.reference(cfg)
    killed = runs.killed({**cfg, "kill_after_batches": 12})
    last = runner.checkpoints(killed)[-1]
    assert runner.checkpoint_position(last)[:2] == (10, 10), "the test means to resume from epoch 0's end"
    resumed, out = runs.run({**cfg, "resume": str(last)}, "resumed-epoch-end")
    assert_same_run(ref, ref_out, [killed, out], resumed)
    line = resume_line(resumed["stderr"])
    assert ": exact (restore verified:" in line, line


def _digest(batches: list[Any]) -> str:
    return hashlib.sha256(b"".join(b["x"].numpy().tobytes() + b["i"].numpy().tobytes() for b in batches)).hexdigest()


def _ours(user: Any, counter: int = 0) -> Any:
    key = StreamKey("train", 0)
    return nodes.take_over(user, seed=3, rank=0, stream=key, counter=lambda: counter, consumed=None, warn=print)


def _loader(workers: int, **spec: Any) -> Any:
    cfg = {"pipeline": {"lib": "nodes", "data": "-", **spec}, "batch_size": 4, "num_workers": workers}
    return streaming_pipelines.train_loader(cfg, 0, 1)


def test_a_pipelines_batches_are_the_same_with_any_workers_and_leave_the_process_streams() -> None:
    """Each item's draws are keyed by its place in the pass, whichever process maps it; the order and the draws
    never move the training process's streams; the user's loader and sampler are left as they were."""
    user = _loader(2)
    sampler = user.root.source.source.source.source.sampler  # Prefetcher > Mapper > Batcher > ParallelMapper
    assert sampler.generator is None
    digests, after = [], []
    for workers in (0, 1, 2):
        torch.manual_seed(0)
        ours = _ours(_loader(workers, prefetch=workers != 0, custom=workers == 1))  # a user's node between: the same
        assert type(ours).__name__ == "Loader"
        assert isinstance(ours, tn.Loader)
        assert nodes.is_taken_over(ours)
        digests.append(_digest(list(ours)))
        after.append(torch.rand(1).item())
    torch.manual_seed(0)
    digests.append(_digest(list(_ours(_loader(2, prebatch=3)))))  # the workers map 3 items at a time
    assert after == [torch.rand(1).item()] * 3, "taking the pipeline's order or its items moved torch's stream"
    assert len(set(digests)) == 1, digests
    assert _digest(list(_ours(_loader(2), counter=1))) != digests[0], "epoch 1 read what epoch 0 read"
    assert not nodes.is_taken_over(user)
    assert sampler.generator is None
    assert user._it is None


def test_a_mixtures_batches_are_the_same_with_any_workers_and_its_seed_is_ours() -> None:
    """A ``MultiNodeWeightedSampler``'s sources are taken over (the same batches with 0, 1, 2 workers, the process
    streams unmoved); its seed comes from the run's seed (another seed, another mixture), the user's node as it was."""
    user = _loader(2, mix=True, prefetch=False)
    digests, after = [], []
    for workers in (0, 1, 2):
        torch.manual_seed(0)
        digests.append(_digest(list(_ours(_loader(workers, mix=True, prefetch=False)))))  # restarts in this thread
        after.append(torch.rand(1).item())
    assert after == [after[0]] * 3
    torch.manual_seed(0)
    assert after[0] == torch.rand(1).item(), "taking the pipeline's order or its items moved torch's stream"
    assert len(set(digests)) == 1, digests
    ours = _ours(user)
    assert _digest(list(ours)) == digests[0]
    mixture = ours.root.source.source  # Mapper > Batcher > the mixture
    assert isinstance(mixture, tn.MultiNodeWeightedSampler)
    assert mixture.seed != user.root.source.source.seed == 0, "the mixture's seed is not the run's"
    assert nodes.why_not_exact(user) == []
    other = nodes.take_over(
        _loader(2, mix=True, prefetch=False),
        seed=4,
        rank=0,
        stream=StreamKey("train", 0),
        counter=lambda: 0,
        consumed=None,
        warn=print,
    )
    assert _digest(list(other)) != digests[0], "another run seed mixed the sources alike"


def test_what_cannot_be_pinned_is_warned_and_said_in_the_resume_line() -> None:
    """A ``map_fn`` in threads (``method="thread"``, or a ``Mapper`` under a ``Prefetcher``) shares the process
    streams with training; a node lightning-repro does not know is left as it is. ``default_collate`` under a
    ``Prefetcher`` draws nothing: no warning."""
    messages: list[str] = []
    ours = nodes.take_over(
        _loader(2, method="thread"),
        seed=3,
        rank=0,
        stream=StreamKey("train", 0),
        counter=lambda: 0,
        consumed=None,
        warn=messages.append,
    )
    [message] = messages
    assert "runs `__getitem__` in threads (method='thread')" in message, message
    assert nodes.nodes_position(ours, 4) == (False, f"torchdata.nodes Loader: {nodes.why_not_exact(ours)[0]}")
    assert "runs in the thread of a Prefetcher" in nodes.why_not_exact(_loader(0))[0]
    assert nodes.why_not_exact(_loader(2)) == []

    class Drawing(torch.utils.data.Sampler):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 4

        def __iter__(self) -> Any:
            return iter(torch.randperm(4).tolist())  # from torch's global stream: no generator of its own

    def mixture() -> Any:
        sources = {"a": tn.SamplerWrapper(Drawing()), "b": tn.SamplerWrapper(torch.utils.data.SequentialSampler([0]))}
        return tn.MultiNodeWeightedSampler(sources, {"a": 0.5, "b": 0.5})

    [reason] = nodes.why_not_exact(tn.Loader(tn.Prefetcher(mixture(), 2)))  # a source restarted in its thread
    assert "its sampler Drawing has no `generator` and is restarted by a MultiNodeWeightedSampler" in reason, reason
    assert nodes.why_not_exact(tn.Loader(mixture())) == []  # restarted in the main thread: its draws are keyed

    class Shuffler(tn.BaseNode):  # type: ignore[misc]
        def __init__(self, source: Any, other: Any = None) -> None:
            super().__init__()
            self.source, self.other = source, other

    key = StreamKey("train", 0)
    user = tn.Loader(Shuffler(_loader(0, prefetch=False).root))  # a node of the user's own over one source
    messages.clear()
    ours = nodes.take_over(user, seed=3, rank=0, stream=key, counter=int, consumed=None, warn=messages.append)
    assert nodes.is_taken_over(ours)
    assert type(ours.root) is Shuffler
    assert ours.root.source is not user.root.source, "the nodes under it are ours"
    [message] = messages
    assert "its node Shuffler is not one of torchdata's, so what it draws, if anything, is not pinned" in message
    assert "`lightning_repro_draws_nothing = True` on its class" in message
    assert not nodes.nodes_position(ours, 4)[0]
    Shuffler.lightning_repro_draws_nothing = True  # type: ignore[attr-defined]
    assert nodes.why_not_exact(user) == []
    user = tn.Loader(Shuffler(_loader(0, prefetch=False).root, [_loader(0).root]))  # another node it holds
    messages.clear()
    assert nodes.take_over(user, seed=3, rank=0, stream=key, counter=int, consumed=None, warn=messages.append) is user
    [message] = messages
    assert "its node Shuffler is not one lightning-repro knows" in message, message


def test_lightnings_check_of_the_users_loader_starts_no_iterator() -> None:
    """Lightning calls ``iter()`` on the user's ``Loader`` before handing it over (``_check_dataloader_iterable``, in
    the loops' ``setup_data``): the reading thread of that iterator drew the ``RandomSampler``'s seed from torch's
    global RNG, in the training process, whenever it ran (two runs differed), and its worker processes were left
    running (the process then hung at exit, joining them). During ``setup_data`` the check is skipped for it."""
    import lightning.pytorch as pl
    from lightning.pytorch.loops import fit_loop
    from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
    from lightning.pytorch.trainer.states import TrainerFn

    check = fit_loop._check_dataloader_iterable
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    user, source = _loader(2), _DataLoaderSource(None, "train_dataloader")
    with nodes.quiet_iterable_check(trainer.fit_loop.setup_data):
        assert fit_loop._check_dataloader_iterable is not check  # the name the loop calls, during its setup_data
        fit_loop._check_dataloader_iterable(user, source, TrainerFn.FITTING)
        with pytest.raises(TypeError):  # what is not a Loader is still checked
            fit_loop._check_dataloader_iterable(object(), source, TrainerFn.FITTING)
    assert fit_loop._check_dataloader_iterable is check
    assert user._it is None, "the check started an iterator of the user's Loader"


def test_the_saved_state_is_the_one_after_the_consumed_batches() -> None:
    """Lightning fetches a batch ahead of training, which the loader's own state counts: the copy's ``state_dict()``
    is its state after the batches training consumed; without one recorded, a warning says the file is a fetch ahead."""
    consumed, messages = [0], []
    ours = nodes.take_over(
        _loader(0, prefetch=False),
        seed=3,
        rank=0,
        stream=StreamKey("train", 0),
        counter=lambda: 0,
        consumed=lambda: consumed[0],
        warn=messages.append,
    )
    iterator = iter(ours)
    _, _, third = next(iterator), next(iterator), next(iterator)  # training consumed 2, Lightning fetched the third
    consumed[0] = 2
    state = ours.state_dict()
    assert state["num_yielded"] == 2
    assert messages == []
    again = _ours(_loader(0, prefetch=False))
    again.load_state_dict(state)
    assert _digest([next(iter(again))]) == _digest([third]), "the resumed loader's first batch is not the third"
    consumed[0] = 9
    assert ours.state_dict()["num_yielded"] == 3
    [message] = messages
    assert "no state of the torchdata.nodes Loader after the 9 batches" in message, message


@pytest.mark.parametrize("steps", [1, 3])
def test_a_pass_cut_by_max_steps_leaves_no_worker_running(steps: int) -> None:
    """A fit that stops mid-pass (``max_steps``): our copy's ``ParallelMapper`` threads and workers end with the run,
    its threads before its workers (they kept the process from exiting, as Lightning's own do with the user's
    ``Loader``; stopped all at once, a sort thread unpickling a worker's tensor failed: pytest makes that an error)."""
    import lightning.pytorch as pl

    from lightning_repro import DeterminismCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(streaming_pipelines.DIM, 1)

        def training_step(self, batch: Any, index: int) -> Any:
            return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[DeterminismCallback(seed=3)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), train_dataloaders=_loader(2))
    ours = trainer.train_dataloader
    assert nodes.is_taken_over(ours)
    mapper = ours.root.source.source.source._it._it  # our ParallelMapper's iterator (Prefetcher > Mapper > Batcher >)
    assert vars(mapper)[nodethreads.ENDED], "the pass had worker processes"
    assert not mapper._read_thread.is_alive()
    assert not mapper._sort_thread.is_alive()
    assert [worker.exitcode for worker in vars(mapper)[nodethreads.ENDED]] == [0, 0], (
        "our workers outlived the run or were killed"
    )
    assert len(list(ours)) == 10, "the loader iterates again after the stop (a pass of 40 items in batches of 4)"
    # that pass's threads end by themselves, a moment after its last batch; the loader is in the trainer's reference
    # cycles, so a garbage collection that an exiting sort thread triggers would run torchdata's __del__ there, whose
    # join of that very thread raises ("cannot join current thread": an unraisable error pytest fails the test on;
    # seen once, on a loaded machine): end them here, in this thread
    nodethreads.stop_threads(ours.root)


def test_a_pass_cut_short_is_stopped_safely_when_the_loader_is_iterated_again() -> None:
    """An evaluation pass cut by ``limit_val_batches`` leaves its iterator running; the next ``iter()`` of our copy
    ends its threads, then its workers (exit code 0, not killed), before torchdata's reset; the new pass is whole and
    the same as the second pass of a fresh copy (a loader iterated twice in an epoch reads a new order the second
    time)."""
    ours = _ours(_loader(2))
    first = iter(ours)
    head = [next(first) for _ in range(2)]
    mapper = ours.root.source.source.source._it._it
    assert all(worker.is_alive() for worker in mapper._workers), "the cut pass's workers run until the next iter()"
    again = list(ours)
    assert not mapper._read_thread.is_alive()
    assert not mapper._sort_thread.is_alive()
    assert [worker.exitcode for worker in vars(mapper)[nodethreads.ENDED]] == [0, 0]
    fresh = _ours(_loader(2))
    assert _digest(list(fresh)[:2]) == _digest(head)
    assert len(again) == 10
    assert _digest(again) == _digest(list(fresh))


def test_the_resume_line_does_not_say_an_iterable_wrappers_draws_are_keyed_in_a_thread() -> None:
    """An ``IterableWrapper`` pulled in a thread (a ``Prefetcher``'s) is positioned by torchdata, but what its iterable
    draws there is not keyed: the resume line says so (exact only if it draws nothing); pulled in the main thread, its
    draws are keyed, and so is a graph without one."""
    threaded = tn.Prefetcher(tn.Batcher(tn.IterableWrapper(range(8)), 4), 2)
    main = tn.Batcher(tn.IterableWrapper(range(8)), 4)
    for root, said in ((threaded, True), (main, False), (_loader(0, prefetch=False).root, False)):
        ours = _ours(tn.Loader(root))
        ours.load_state_dict(ours.state_dict())
        exact, text = nodes.nodes_position(ours, 1)
        assert exact
        assert ("but its IterableWrapper's iterable's, pulled in a thread, as they are" in text) is said, text
        assert text.endswith("its draws keyed") is not said, text


class _Drawing:
    """An iterable whose ``iter()`` and items draw from the process streams (a shuffle, an augmentation)."""

    def __iter__(self) -> Any:
        order = torch.randperm(12).tolist()
        for i in order:
            yield {"i": i, "x": torch.rand(2) + random.random()}


def test_an_iterable_wrappers_draws_in_the_main_thread_are_keyed_and_resume() -> None:
    """Pulled in the main thread, an ``IterableWrapper``'s ``iter()`` and each item's ``next()`` draw on the pass's
    streams (the process streams put back): the same items whatever the streams held, another epoch reads others,
    and a pass resumed from the state after one batch (its items read again on their streams) goes on alike."""

    def loader() -> Any:
        return tn.Loader(tn.Batcher(tn.IterableWrapper(_Drawing()), 4))

    def flat(batches: list[Any]) -> list[Any]:
        return [(item["i"], item["x"].tolist()) for batch in batches for item in batch]

    torch.manual_seed(1)
    random.seed(1)
    first = flat(list(_ours(loader())))
    after = torch.rand(1).item(), random.random()
    torch.manual_seed(1)
    random.seed(1)
    assert after == (torch.rand(1).item(), random.random()), "the iterable's draws moved the process streams"
    torch.manual_seed(2)
    assert flat(list(_ours(loader()))) == first, "the iterable's draws are not keyed"
    assert flat(list(_ours(loader(), counter=1))) != first, "epoch 1 read what epoch 0 read"
    interrupted = _ours(loader())
    head = next(iter(interrupted))
    state = interrupted.state_dict()
    torch.manual_seed(3)
    resumed = _ours(loader())
    resumed.load_state_dict(state)
    assert flat([head, *resumed]) == first


def _slow_after_the_first_items(started: str, item: int) -> int:
    if item >= 4:  # the items after the first batch: a map that outlasts the grace the stop gives the workers
        Path(started, str(item)).touch()
        time.sleep(30)
    return item


def test_a_worker_that_does_not_end_in_time_is_killed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The stop gives a mapper's workers a grace to finish the items they hold, then kills those still running
    (nothing reads their output any more), so the run's end cannot hang on a slow ``map_fn``."""
    from lightning_repro.data import nodethreads

    monkeypatch.setattr(nodethreads, "_GRACE", 1.0)
    slow = functools.partial(_slow_after_the_first_items, str(tmp_path))
    mapper = tn.ParallelMapper(tn.SamplerWrapper(range(40)), slow, 2, method="process")
    loader = tn.Loader(tn.Batcher(mapper, batch_size=4))
    assert next(iter(loader)) == [0, 1, 2, 3]
    workers = loader.root.source._it._it._workers
    deadline = time.monotonic() + 60
    while not any(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)  # until a worker maps a slow item
    assert any(tmp_path.iterdir()), "no worker started a slow item"
    started = time.monotonic()
    nodethreads.stop_threads(loader.root)
    assert time.monotonic() - started < 10, "the stop waited for the slow map"
    codes = [worker.exitcode for worker in workers]
    assert None not in codes, "a worker outlived the stop"
    assert -9 in codes, f"no worker was killed (exit codes {codes}): the one mapping a slow item must have been"


def test_a_stopped_iterator_inherited_by_a_later_worker_does_not_touch_the_ended_workers() -> None:
    """A worker forked later (the next fit's, a later pass's) inherits the stopped iterator; when it collects it,
    torchdata's ``__del__`` asked each ended worker ``is_alive()``, which only the parent may ask: every such worker
    printed an ``AssertionError`` traceback ("can only test a child process")."""
    import multiprocessing

    ours = _ours(_loader(2))
    next(iter(ours))
    mapper = ours.root.source.source.source._it._it
    nodethreads.stop_threads(ours.root)
    assert [worker.exitcode for worker in vars(mapper)[nodethreads.ENDED]] == [0, 0]

    def collect() -> None:  # in the forked child: what its garbage collection of the iterator runs
        try:
            mapper._shutdown()
        except AssertionError:
            raise SystemExit(3) from None

    child = multiprocessing.get_context("fork").Process(target=collect)
    child.start()
    child.join()
    assert child.exitcode == 0
