"""The dataloader takeover, in process: sample-keyed streams, worker seeding, index-level skipping."""

from __future__ import annotations

import logging
import os
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helpers
import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_repro import NotExactWarning, capture_process_streams
from lightning_repro._warn import WarningCache
from lightning_repro.data import fastrng as _fastrng
from lightning_repro.data.takeover import ReproBatchSampler, StreamKey, prepare_dataloader
from lightning_repro.rng import digest_process_streams


class Augmenting(Dataset):  # type: ignore[type-arg]
    """Returns (index, a torch draw, a numpy draw, a python draw): the sample's 'augmentation'."""

    def __init__(self, n: int = 40) -> None:
        self.n = n
        self.loads: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loads.append(i)
        return torch.tensor(
            [float(i), float(torch.rand(())), float(np.random.rand()), random.random()], dtype=torch.float64
        )


class Batched(Augmenting):
    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        noise = torch.rand(len(indices))  # one draw for the whole batch
        return [
            torch.tensor([float(i), float(n), 0.0, 0.0], dtype=torch.float64)
            for i, n in zip(indices, noise, strict=False)
        ]


Counter = helpers.Counter
_prepare = helpers.prepare


def _samples(loader: DataLoader[Any]) -> dict[int, tuple[float, ...]]:
    out: dict[int, tuple[float, ...]] = {}
    for batch in loader:
        for row in batch.reshape(-1, 4):
            out[int(row[0])] = tuple(float(v) for v in row[1:])
    return out


def _order(loader: DataLoader[Any]) -> list[int]:
    return [int(row[0]) for batch in loader for row in batch.reshape(-1, 4)]


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_augmentation_does_not_depend_on_workers(num_workers: int) -> None:
    reference = _samples(_prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True)))
    loader = _prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True, num_workers=num_workers))
    assert _samples(loader) == reference
    assert _order(_prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True, num_workers=num_workers))) == _order(
        _prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True))
    )


def test_augmentation_does_not_depend_on_batch_size_or_order() -> None:
    shuffled = _samples(_prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True)))
    sequential = _samples(_prepare(DataLoader(Augmenting(), batch_size=5, shuffle=False)))
    assert shuffled == sequential  # keyed by (seed, loader, epoch, index) alone


def test_a_sample_differs_between_epochs_and_samples_do_not_share_streams() -> None:
    counter = Counter(0)
    loader = _prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True), counter)
    epoch0 = _samples(loader)
    counter.value = 1
    epoch1 = _samples(loader)
    assert all(epoch0[i] != epoch1[i] for i in epoch0)
    for epoch in (epoch0, epoch1):
        for column in range(3):
            values = [v[column] for v in epoch.values()]
            assert len(set(values)) == len(values)  # no two samples drew the same number from any stream
    assert _order(_prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True), Counter(0))) != _order(
        _prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True), Counter(1))
    )


def test_other_seed_other_augmentation() -> None:
    a = _samples(_prepare(DataLoader(Augmenting(), batch_size=4)))
    loader = prepare_dataloader(
        DataLoader(Augmenting(), batch_size=4), seed=8, rank=0, stream=StreamKey("train", 0), counter=Counter()
    )
    b = _samples(loader)
    assert all(a[i] != b[i] for i in a)


def test_main_process_loading_never_moves_the_process_streams() -> None:
    loader = _prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True))
    before = digest_process_streams(capture_process_streams())
    for _ in loader:
        pass
    assert digest_process_streams(capture_process_streams()) == before
    plain = DataLoader(Augmenting(), batch_size=4, shuffle=True)
    for _ in plain:
        pass
    assert digest_process_streams(capture_process_streams()) != before  # the control: plain loading does


class WorkerStream(IterableDataset):  # type: ignore[type-arg]
    """Yields one draw per worker from the worker's own streams (no sample index)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield torch.tensor([float(torch.rand(())), float(np.random.rand()), random.random()])


def test_worker_streams_are_distinct_and_reproducible() -> None:
    def draws() -> list[tuple[float, ...]]:
        loader = _prepare(DataLoader(WorkerStream(), batch_size=None, num_workers=3))  # supported: no warning
        return [tuple(float(v) for v in t) for t in loader]

    first = draws()
    assert draws() == first
    assert len({v for row in first for v in row}) == 9  # three workers x three streams, all distinct


def _record_worker(worker_id: int) -> None:
    Path(os.environ["REPRO_MARKERS"], f"{worker_id}").write_text(str(float(torch.rand(()))))


def test_user_worker_init_fn_runs_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPRO_MARKERS", str(tmp_path))
    reference = _samples(_prepare(DataLoader(Augmenting(), batch_size=4)))
    loader = _prepare(DataLoader(Augmenting(), batch_size=4, num_workers=2, worker_init_fn=_record_worker))
    assert _samples(loader) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("skip", [0, 1, 4, 9, 10])
def test_resume_skips_at_the_index_level(shuffle: bool, skip: int) -> None:
    full = _order(_prepare(DataLoader(Augmenting(), batch_size=4, shuffle=shuffle)))
    dataset = Augmenting()
    loader = _prepare(DataLoader(dataset, batch_size=4, shuffle=shuffle))
    sampler = loader.batch_sampler
    assert isinstance(sampler, ReproBatchSampler)
    assert sampler.exact_skip
    sampler.resume_at(0, 0, skip)
    rest = _order(loader)
    assert rest == full[skip * 4 :]
    assert dataset.loads == rest  # no skipped sample was loaded, none loaded twice


def test_resume_keeps_the_augmentation_of_the_remaining_samples() -> None:
    full = _samples(_prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True)))
    loader = _prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True, num_workers=2))
    loader.batch_sampler.resume_at(0, 0, 3)  # type: ignore[union-attr]
    rest = _samples(loader)
    assert len(rest) == 40 - 12
    assert all(full[i] == v for i, v in rest.items())


def test_skip_of_a_huge_epoch_is_sliced_not_replayed() -> None:
    class Huge(Augmenting):
        def __len__(self) -> int:
            return 4_000_000

    dataset = Huge()
    loader = _prepare(DataLoader(dataset, batch_size=4, shuffle=True))
    loader.batch_sampler.resume_at(0, 0, 999_990)  # type: ignore[union-attr]
    batches = list(loader)
    assert len(batches) == 1_000_000 - 999_990
    assert len(dataset.loads) == 40


class EveryOther(Sampler[int]):
    """A custom sampler with no generator attribute that draws from the global torch RNG."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        offset = int(torch.randint(0, 2, ()))
        yield from range(offset, self.n, 2)

    def __len__(self) -> int:
        return self.n // 2


def _info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    name = "lightning_repro.data.takeover"
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelname == "INFO"]


def test_custom_sampler_runs_on_a_private_stream(caplog: pytest.LogCaptureFixture) -> None:
    cache = WarningCache()
    # supported and exact (its order replays from the seed): one info line, no warning (warnings are errors here)
    with caplog.at_level(logging.INFO, logger="lightning_repro.data.takeover"):
        first = _prepare(DataLoader(Augmenting(), batch_size=4, sampler=EveryOther(40)), warning_cache=cache)
    [line] = _info_lines(caplog)
    assert line.startswith("EveryOther is a sampler lightning-repro does not compute:")
    assert "private stream" in line
    assert line.endswith(": exact.")
    before = digest_process_streams(capture_process_streams())
    order = _order(first)
    assert digest_process_streams(capture_process_streams()) == before  # the sampler's draw did not touch ours
    second = _prepare(DataLoader(Augmenting(), batch_size=4, sampler=EveryOther(40)), warning_cache=cache)
    assert _order(second) == order
    second.batch_sampler.resume_at(0, 0, 2)  # type: ignore[union-attr]
    assert _order(second) == order[8:]


def test_custom_batch_sampler_and_batched_getitems(caplog: pytest.LogCaptureFixture) -> None:
    cache = WarningCache()  # what the callback holds: one per run
    with caplog.at_level(logging.INFO, logger="lightning_repro.data.takeover"):
        loader = _prepare(
            DataLoader(Batched(), batch_sampler=_Chunks(SequentialSampler(range(40)), 5, False)), warning_cache=cache
        )
        first = _samples(loader)
        # said once per cause: no second line with the same cache
        chunks = _Chunks(SequentialSampler(range(40)), 5, False)
        again = _samples(_prepare(DataLoader(Batched(), batch_sampler=chunks, num_workers=2), warning_cache=cache))
    said = [line.split(":")[0] for line in _info_lines(caplog)]
    assert said == ["_Chunks is a sampler lightning-repro does not compute"]
    assert first == again
    assert len({v[0] for v in first.values()}) == 40


class _Chunks(BatchSampler):
    """A BatchSampler subclass: treated as custom."""


def test_no_auto_collation_path() -> None:
    reference = _prepare(DataLoader(Augmenting(), batch_size=None, shuffle=True))
    values = [tuple(float(v) for v in t) for t in reference]
    loader = _prepare(DataLoader(Augmenting(), batch_size=None, shuffle=True, num_workers=2))
    assert [tuple(float(v) for v in t) for t in loader] == values
    # the batched path inlines mix_seed for speed: it must key every sample exactly like the unbatched one
    batched = _samples(_prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True)))
    assert {
        int(t[0]): tuple(float(v) for v in t[1:])
        for t in _prepare(DataLoader(Augmenting(), batch_size=None, shuffle=True))
    } == batched


def test_not_a_dataloader_is_returned_unchanged_with_a_warning() -> None:
    thing = [torch.zeros(2)]
    with pytest.warns(NotExactWarning, match="cannot take over a list"):
        assert _prepare(thing) is thing  # type: ignore[arg-type]


def test_warnings_are_remembered_by_the_cache_the_caller_holds() -> None:
    """Once per cause and per cache (the callback holds one): a second run in the process is warned again."""
    import warnings

    first, second = WarningCache(), WarningCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cache in (first, first, second):
            _prepare([torch.zeros(2)], warning_cache=cache)  # type: ignore[arg-type]
    messages = [str(w.message) for w in caught if issubclass(w.category, NotExactWarning)]
    assert len(messages) == 2
    assert messages[0] == messages[1]
    assert "cannot take over a list" in messages[0]
    assert first == second == set(messages)


class Resumable(WorkerStream):
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SizedResumable(Resumable):
    def __len__(self) -> int:
        return 1


def test_iterable_dataset_with_state_dict_and_len_gets_no_warning() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _prepare(DataLoader(SizedResumable(), batch_size=None))


@pytest.mark.parametrize(
    ("dataset", "workers"),
    [(WorkerStream(), 0), (WorkerStream(), 2), (Resumable(), 0), (SizedResumable(), 2)],
    ids=["no-state", "no-state-workers", "state-no-len", "state-len-workers"],
)
def test_an_iterable_dataset_resumes_exactly_so_gets_no_warning(dataset: Any, workers: int) -> None:
    """Per-worker positions (its own state, or a fast-forward) make every one of them exact: nothing to warn; with
    persistent workers too (without a batch size, each pass's key reaches them through shared memory)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _prepare(DataLoader(dataset, batch_size=None, num_workers=workers))
        if workers:
            _prepare(DataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=True))


def test_an_iterable_loader_that_cannot_be_exact_is_warned() -> None:
    with pytest.warns(NotExactWarning, match="in_order=False"):
        _prepare(DataLoader(WorkerStream(), batch_size=2, num_workers=2, in_order=False))


def test_preparing_twice_does_not_wrap_twice() -> None:
    loader = _prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True))
    sampler = loader.batch_sampler
    first_pass = _order(loader)
    again = _prepare(loader)
    assert again.batch_sampler is sampler
    fresh = _prepare(DataLoader(Augmenting(), batch_size=4, shuffle=True))
    assert _order(fresh) == first_pass
    assert _order(again) == _order(fresh)  # the second pass of the same epoch, in both
    assert _order(again) != first_pass


def test_iterable_worker_streams_are_keyed_by_epoch() -> None:
    """An epoch's worker streams are the same whether the loader ran earlier epochs or was just made (a resume)."""

    def make(counter: Counter) -> DataLoader[Any]:
        return _prepare(DataLoader(WorkerStream(), batch_size=None, num_workers=2), counter)

    counter = Counter(0)
    running = make(counter)
    epoch0 = [tuple(t.tolist()) for t in running]
    counter.value = 1
    epoch1 = [tuple(t.tolist()) for t in running]
    fresh = [tuple(t.tolist()) for t in make(Counter(1))]
    assert epoch1 == fresh
    assert set(epoch0).isdisjoint(epoch1)


class Gaussian(Augmenting):
    def __getitem__(self, i: int) -> torch.Tensor:
        self.loads.append(i)
        return torch.tensor(
            [float(i), float(np.random.randn()), float(np.random.randn(3).sum()), 0.0], dtype=torch.float64
        )


@pytest.mark.parametrize("raw", [True, False], ids=["raw-copy", "public-api"])
def test_numpy_state_with_cached_gaussian_survives_loading(raw: bool, monkeypatch: pytest.MonkeyPatch) -> None:

    if raw:
        assert _fastrng.NUMPY_RAW is not None  # the fast layout was found and checked on this numpy
    else:
        monkeypatch.setattr(_fastrng, "NUMPY_RAW", None)
    np.random.seed(1)
    np.random.randn()  # the process stream now holds a cached Box-Muller value
    before = digest_process_streams(capture_process_streams())
    samples = _samples(_prepare(DataLoader(Gaussian(), batch_size=4, shuffle=True)))
    assert digest_process_streams(capture_process_streams()) == before
    monkeypatch.setattr(_fastrng, "NUMPY_RAW", None)
    assert _samples(_prepare(DataLoader(Gaussian(), batch_size=4, shuffle=True))) == samples  # both paths agree


class PythonGauss(Augmenting):
    def __getitem__(self, i: int) -> torch.Tensor:
        self.loads.append(i)
        return torch.tensor([float(i), random.gauss(0, 1), random.gauss(0, 1), random.gauss(0, 1)], dtype=torch.float64)


def test_python_cached_gaussian_does_not_leak_into_samples() -> None:
    random.seed(3)
    random.gauss(0, 1)  # the process stream caches the second gaussian of the pair
    in_main = _samples(_prepare(DataLoader(PythonGauss(), batch_size=4)))
    random.seed(4)  # no cached gaussian now
    in_workers = _samples(_prepare(DataLoader(PythonGauss(), batch_size=4, num_workers=2)))
    assert in_main == in_workers


def test_the_batch_sampler_interface() -> None:
    sampler = SequentialSampler(range(40))
    batch_sampler = _prepare(DataLoader(Augmenting(), batch_size=4, sampler=sampler, drop_last=True)).batch_sampler
    assert isinstance(batch_sampler, ReproBatchSampler)
    assert batch_sampler.sampler is sampler
    assert batch_sampler.batch_size == 4
    assert batch_sampler.drop_last is True
    unbatched = _prepare(DataLoader(Augmenting(), batch_size=None, sampler=sampler)).sampler
    assert isinstance(unbatched, ReproBatchSampler)
    assert unbatched.sampler is sampler
    assert unbatched.batch_size is None
    assert unbatched.drop_last is False


class IgnoresGenerator(RandomSampler):
    """Has RandomSampler's `generator` attribute, but draws its order from the global torch RNG."""

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(len(self.data_source)).tolist()


class HonoursGenerator(RandomSampler):
    """A RandomSampler subclass (so not one we know): its order comes from its `generator`."""


def _foreign(sampler_cls: type[RandomSampler], caplog: pytest.LogCaptureFixture) -> tuple[list[int], str]:
    sampler = sampler_cls(range(40))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_repro.data.takeover"):  # exact: no warning, an info line
        loader = _prepare(DataLoader(Augmenting(), batch_size=4, sampler=sampler))
    [message] = _info_lines(caplog)
    assert message.startswith(f"{sampler_cls.__name__} is a sampler lightning-repro does not compute:")
    before = digest_process_streams(capture_process_streams())
    order = _order(loader)
    assert digest_process_streams(capture_process_streams()) == before  # the sampler's draws did not touch ours
    assert sampler.generator is None  # the user's sampler keeps its own generator
    return order, message


@pytest.mark.parametrize("sampler_cls", [IgnoresGenerator, HonoursGenerator])
def test_a_generator_is_claimed_only_when_checked(
    sampler_cls: type[RandomSampler], caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(1)
    first, message = _foreign(sampler_cls, caplog)
    torch.manual_seed(2)  # other process streams: the order must not change
    assert _foreign(sampler_cls, caplog)[0] == first
    assert sorted(first) == list(range(40))
    if sampler_cls is IgnoresGenerator:
        assert "seeded through" not in message
        assert "has a `generator` attribute, but its order does not follow it" in message
        assert "runs on a private stream" in message
    else:
        assert "it is seeded through its `generator` attribute (checked:" in message
        assert "private stream" not in message


def test_a_prepared_loader_inside_lightnings_index_recorder_is_recognised() -> None:
    from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper

    prepared = _prepare(DataLoader(Augmenting(12), batch_size=4))
    reference = _samples(prepared)
    inner = prepared.batch_sampler
    wrapped = DataLoader(
        prepared.dataset, batch_sampler=_IndexBatchSamplerWrapper(inner), collate_fn=prepared.collate_fn
    )
    again = prepare_dataloader(wrapped, seed=7, rank=0, stream=StreamKey("predict", 0), counter=Counter())
    recorder = again.batch_sampler
    assert isinstance(recorder, _IndexBatchSamplerWrapper)
    assert recorder._batch_sampler is inner  # re-bound, not wrapped twice
    assert inner.stream == StreamKey("predict", 0)
    assert set(_samples(again)) == set(reference)
    assert recorder.seen_batch_indices == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(type(indices) is list for indices in recorder.seen_batch_indices)
