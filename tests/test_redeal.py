"""The re-deal of a pass to another world size (``on_topology_change="reseed"``), on the pure order functions.

No training run: the old ranks' ``ReproBatchSampler`` objects consume ``offset`` batches, the new ranks' samplers
are told where the old ones stood (``describe()`` + ``resume_remapped``), exactly as ``state.apply_data_position``
does on resume, and the indices both yield are compared with the sampler's full pass.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_repro import streams
from lightning_repro.data.order import _order, _pass_order
from lightning_repro.data.takeover import ReproBatchSampler, StreamKey, prepare_dataloader
from lightning_repro.seeding import fold_seed32


class Indices(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _sampler(kind: str, n: int, num_samples: int, world: int, rank: int) -> Any:
    if kind == "random":
        return RandomSampler(Indices(n), num_samples=num_samples)
    return DistributedSampler(Indices(n), num_replicas=world, rank=rank, shuffle=True, drop_last=False)


def _batch_sampler(kind: str, n: int, num_samples: int, batch_size: int, drop_last: bool, world: int, rank: int) -> Any:
    loader = DataLoader(
        Indices(n),
        batch_size=batch_size,
        drop_last=drop_last,
        sampler=_sampler(kind, n, num_samples, world, rank),
    )
    prepared = prepare_dataloader(
        loader, seed=11, rank=rank, stream=StreamKey("train", 0), counter=lambda: 0, world_size=world
    )
    sampler = prepared.batch_sampler
    assert isinstance(sampler, ReproBatchSampler)
    assert sampler.exact_skip
    return sampler


def _indices(batches: Any, limit: int | None = None) -> list[int]:
    out: list[int] = []
    for j, batch in enumerate(batches):
        if limit is not None and j >= limit:
            break
        out.extend(batch.indices)
    return out


def _check_redeal(
    kind: str, n: int, num_samples: int, batch_size: int, drop_last: bool, old_world: int, new_world: int, at: float
) -> None:
    old = [_batch_sampler(kind, n, num_samples, batch_size, drop_last, old_world, r) for r in range(old_world)]
    length = len(old[0])
    offset = round(at * length)
    consumed = [i for sampler in old for i in _indices(iter(sampler), offset)]
    # the sampler's full pass, every index it deals (the batch sampler's drop_last does not change the order)
    full = collections.Counter(
        i
        for r in range(old_world)
        for i in _indices(iter(_batch_sampler(kind, n, num_samples, batch_size, False, old_world, r)))
    )
    saved = old[0].describe()
    new = []
    lengths = set()
    for rank in range(new_world):
        sampler = _batch_sampler(kind, n, num_samples, batch_size, drop_last, new_world, rank)
        sampler.resume_remapped(0, 0, offset, saved)
        length_now = len(sampler)  # what the epoch loop counts for the re-dealt pass
        lengths.add(length_now)
        batches = list(iter(sampler))
        assert length_now == offset + len(batches)
        new.extend(i for batch in batches for i in batch.indices)
    assert len(lengths) == 1, "every new rank must run the same number of batches"
    got = collections.Counter(consumed) + collections.Counter(new)
    repeated = got - full  # only the padding to equal batch counts may repeat a sample
    assert sum(repeated.values()) < new_world, f"repeated: {repeated}"
    missed = full - got
    if drop_last:  # only the new ranks' last incomplete batches may be dropped
        assert sum(missed.values()) < new_world * batch_size, f"missed: {missed}"
    else:
        assert not missed, f"missed: {missed}"


@pytest.mark.parametrize(("n", "num_samples"), [(20, 40), (20, 10), (10, 25)])
def test_random_sampler_with_num_samples_is_redealt_exactly(n: int, num_samples: int) -> None:
    """RandomSampler(num_samples != len(dataset)): the re-deal continues the order the sampler drew."""
    _check_redeal("random", n, num_samples, 4, False, 1, 2, 0.5)


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["random", "distributed"]),
    n=st.integers(1, 30),
    factor=st.floats(0.1, 3.0),
    batch_size=st.integers(1, 7),
    drop_last=st.booleans(),
    old_world=st.integers(1, 4),
    new_world=st.integers(1, 4),
    at=st.floats(0.0, 1.0),
)
def test_redeal_property(
    kind: str,
    n: int,
    factor: float,
    batch_size: int,
    drop_last: bool,
    old_world: int,
    new_world: int,
    at: float,
) -> None:
    num_samples = max(1, round(n * factor))
    if kind == "random":
        old_world = 1  # a RandomSampler deals the whole pass on one rank (Lightning swaps it under DDP)
    _check_redeal(kind, n, num_samples, batch_size, drop_last, old_world, new_world, at)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 30),
    world=st.integers(1, 4),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_pass_order_is_what_distributed_sampler_yields(
    n: int, world: int, drop_last: bool, shuffle: bool, epoch: int
) -> None:
    description = {
        "kind": "distributed",
        "n": n,
        "world_size": world,
        "shuffle": shuffle,
        "sampler_drop_last": drop_last,
    }
    everything = list(_pass_order(description, 123456789, epoch))
    for rank in range(world):
        sampler = DistributedSampler(Indices(n), num_replicas=world, rank=rank, shuffle=shuffle, drop_last=drop_last)
        ours = list(_order(sampler, 123456789, epoch))  # type: ignore[arg-type]
        assert (sampler.seed, sampler.epoch) == (0, 0)  # the sampler is given back as it was
        sampler.seed = fold_seed32(123456789)
        sampler.set_epoch(epoch)
        assert ours == list(iter(sampler))  # torch's own order for that seed and epoch
        assert ours == everything[rank::world]


def test_old_entries_without_num_samples_mean_one_permutation() -> None:
    saved = {"kind": "random", "n": 12}
    order = _pass_order(saved, 5, 0)
    assert sorted(order.tolist()) == list(range(12))  # type: ignore[union-attr]
    assert order.tolist() == _pass_order({**saved, "num_samples": 12}, 5, 0).tolist()  # type: ignore[union-attr]


def _own(seed: int, n: int = 24) -> DistributedSampler[Any]:
    return DistributedSampler(Indices(n), num_replicas=1, rank=0, shuffle=True, seed=seed)


def test_a_user_s_distributed_sampler_seed_changes_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's ``DistributedSampler(seed=S)``: its seed was overwritten by the order seed, so seeds 7 and 8 gave one
    order (plain Lightning and torch give two). It is mixed in now; torch's default 0 and Lightning's own sampler's
    ``PL_GLOBAL_SEED`` are not (their orders, and every digest pinned on them, are as before)."""
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    orders = {seed: list(_order(_own(seed), 123456789, 1)) for seed in (0, 7, 8)}  # type: ignore[arg-type]
    assert len({tuple(order) for order in orders.values()}) == 3
    assert orders[7] == list(_order(_own(7), 123456789, 1))  # type: ignore[arg-type]
    assert orders[7] != list(_order(_own(7), 123456789, 2))  # type: ignore[arg-type]  # each epoch its own
    assert orders[7] != list(_order(_own(7), 987654321, 1))  # type: ignore[arg-type]  # and the callback's seed counts
    base = {"kind": "distributed", "n": 24, "world_size": 1, "shuffle": True, "sampler_drop_last": False}
    assert orders[0] == list(_pass_order(base, 123456789, 1))  # torch's default: the order as before
    assert orders[7] == list(_pass_order({**base, "sampler_seed": 7}, 123456789, 1))  # the re-deal recomputes it
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # the seed Lightning gives the sampler it adds: not the user's
    assert list(_order(_own(7), 123456789, 1)) == orders[0]  # type: ignore[arg-type]
    assert list(_order(_own(8), 123456789, 1)) == orders[8]  # type: ignore[arg-type]


def test_the_description_records_a_user_s_sampler_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    described = {}
    for seed in (0, 7):
        loader = DataLoader(Indices(24), batch_size=4, sampler=_own(seed))
        prepared = prepare_dataloader(loader, seed=11, rank=0, stream=StreamKey("train", 0), counter=lambda: 0)
        sampler = prepared.batch_sampler
        assert isinstance(sampler, ReproBatchSampler)
        described[seed] = sampler.describe()
        order_seed = streams.order_seed(11, StreamKey("train", 0), 0, 0)
        expected = list(_order(_own(seed), order_seed, 0))  # type: ignore[arg-type]
        assert _indices(iter(sampler)) == expected
    assert "sampler_seed" not in described[0]
    assert described[7] == {**described[0], "sampler_seed": 7}
