"""ReproBatchSampler's own position: state_dict()/load_state_dict() round trips, in process (torchdata's style)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

import lightning_repro
from lightning_repro.data.samplers import ReproBatchSampler
from lightning_repro.streams import StreamKey


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def _sampler(kind: str, counter: Counter, *, keyed: bool = True) -> ReproBatchSampler:
    inner: Any = {
        "sequential": lambda: BatchSampler(SequentialSampler(range(23)), 4, False),
        "random": lambda: BatchSampler(RandomSampler(range(23)), 4, True),
        "foreign": lambda: BatchSampler(list(reversed(range(23))), 4, False),  # unknown: advanced index by index
    }[kind]()
    return ReproBatchSampler(
        inner,
        batched=True,
        seed=11,
        rank=0,
        stream=StreamKey("train", 0),
        counter=counter,
        loader_generator=torch.Generator(),
        keyed=keyed,
    )


def test_repro_batch_sampler_is_exported() -> None:
    assert lightning_repro.ReproBatchSampler is ReproBatchSampler
    assert "ReproBatchSampler" in lightning_repro.__all__


@pytest.mark.parametrize("kind", ["sequential", "random", "foreign"])
@pytest.mark.parametrize("taken", [0, 1, 3, 5])
def test_state_dict_round_trip_continues_the_pass(kind: str, taken: int) -> None:
    full = list(_sampler(kind, Counter(2)))
    running = _sampler(kind, Counter(2))
    assert running.exact_skip is (kind != "foreign")  # both ways of skipping: sliced, and index by index
    iterator = iter(running)
    head = [next(iterator) for _ in range(taken)]
    state = running.state_dict()
    assert state == {"version": 1, "counter": 2, "pass": 0, "batches": taken}
    resumed = _sampler(kind, Counter(2))
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # a loaded position reads back before the pass starts
    rest = list(resumed)
    assert head + rest == full
    assert rest == list(iterator)  # the same batches (and sample seeds) as the run that went on
    assert resumed.state_dict() == {"version": 1, "counter": 2, "pass": 1, "batches": 0}  # the pass ran out


def test_state_dict_of_a_later_pass_and_epoch() -> None:
    counter = Counter(0)
    running = _sampler("random", counter)
    list(running)  # pass 0 of epoch 0
    iterator = iter(running)  # pass 1 of epoch 0 (a cycled loader)
    next(iterator)
    assert running.state_dict() == {"version": 1, "counter": 0, "pass": 1, "batches": 1}
    second = _sampler("random", Counter(0))
    second.load_state_dict(running.state_dict())
    assert list(second) == list(iterator)
    counter.value = 1
    fresh = _sampler("random", Counter(1))
    assert fresh.state_dict() == {"version": 1, "counter": 1, "pass": 0, "batches": 0}
    assert list(running) == list(fresh)  # epoch 1's first pass, whatever came before


def test_resume_at_is_load_state_dict() -> None:
    by_method = _sampler("random", Counter(4))
    by_method.resume_at(4, 1, 2)
    by_state = _sampler("random", Counter(4))
    by_state.load_state_dict({"counter": 4, "pass": 1, "batches": 2})  # no "version": an older state reads too
    assert by_method.state_dict() == by_state.state_dict() == {"version": 1, "counter": 4, "pass": 1, "batches": 2}
    assert list(by_method) == list(by_state)
    assert len(list(by_state)) == 5  # the next pass: 5 batches of the 23 samples, drop_last


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"counter": 1, "pass": 0}, r"`state_dict\['batches'\]` must be a non-negative int, got None"),
        ({"counter": -1, "pass": 0, "batches": 0}, r"`state_dict\['counter'\]` must be a non-negative int, got -1"),
        ({"counter": 1, "pass": True, "batches": 0}, r"`state_dict\['pass'\]` must be a non-negative int, got True"),
        ({"version": 2, "counter": 1, "pass": 0, "batches": 0}, r"newer lightning-repro"),
    ],
)
def test_load_state_dict_refuses_a_bad_state(state: dict[str, Any], message: str) -> None:
    sampler = _sampler("sequential", Counter())
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == {"version": 1, "counter": 0, "pass": 0, "batches": 0}  # nothing was changed


def test_the_resume_line_says_what_a_loader_beside_a_longer_one_skips() -> None:
    """The resume line's skip is each loader's own in its pass: the epoch's batches for the longest loader, the rest
    of a pass cycled beside it (``max_size_cycle``), all of a pass that ran out (``max_size``), the rest of a pass
    after an epoch that ended first."""
    from torch.utils.data import DataLoader

    from lightning_repro.data.resumeline import data_position

    def loader(pass_: int, skip: int, kind: str = "sequential") -> Any:  # 23 items in batches of 4: 6 batches
        sampler = _sampler(kind, Counter(0))
        sampler.resume_at(0, pass_, skip)
        return DataLoader(range(23), batch_sampler=sampler)

    exact, said = data_position([loader(0, 9), loader(1, 3), loader(0, 6)], 9, sample_keyed=True)
    assert exact
    assert said == [  # each named: the line lists the loaders in order
        "loader 0: O(1) skip of 9 batches",
        "loader 1: O(1) skip of 3 batches in its pass 2 of the epoch (cycled beside a longer loader)",
        "loader 2: O(1) skip of 6 batches (all of its pass: it ran out before the longest loader)",
    ], said
    assert data_position([loader(0, 1)], 1, sample_keyed=True) == (True, ["O(1) skip of 1 batch"])  # not "1 batches"
    # an epoch that ended before the pass did (limit_train_batches=4, resumed on its last batch): the rest is skipped
    exact, said = data_position([loader(0, 6)], 4, sample_keyed=True)
    assert exact
    assert said == ["O(1) skip of 6 batches (the rest of its pass: the epoch ended after 4 of them)"], said
    _, said = data_position([loader(1, 3, "foreign")], 9, sample_keyed=True)  # its sampler: a list
    assert said == [
        "index-by-index skip of 3 batches of list in its pass 2 of the epoch (cycled beside a longer loader)"
        " (no data loaded)"
    ], said
