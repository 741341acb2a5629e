from __future__ import annotations

import io
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_repro import CorruptStateError, capture_process_streams, fork_process_streams, restore_process_streams
from lightning_repro.rng import digest_process_streams, validate_process_streams


def _draw() -> tuple[float, float, float, float, float]:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()), float(torch.rand(()))


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=0, max_value=50))
def test_capture_restore_round_trip(seed: int, burn: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    for _ in range(burn):  # leave each stream mid-way, cached gaussians included
        random.gauss(0, 1)
        np.random.randn()
        torch.rand(3)
    state = capture_process_streams()
    expected = _draw()
    random.seed(seed + 1)
    np.random.seed(0)
    torch.manual_seed(0)
    restore_process_streams(state)
    assert _draw() == expected


def test_state_survives_weights_only_load() -> None:
    np.random.randn()  # a cached gaussian
    state = capture_process_streams()
    expected = _draw()
    buffer = io.BytesIO()
    torch.save({"entry": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["entry"]
    assert digest_process_streams(loaded) == digest_process_streams(state)
    restore_process_streams(loaded)
    assert _draw() == expected


def _damaged(part: str) -> dict[str, Any]:
    state = capture_process_streams()
    if part == "missing":
        del state["numpy"]
    elif part == "python":
        state["python"]["words"] = state["python"]["words"][:10]
    elif part == "python-range":
        state["python"]["words"] = state["python"]["words"].clone()
        state["python"]["words"][3] = 2**40
    elif part == "numpy":
        state["numpy"]["pos"] = 9999
    elif part == "torch":
        state["torch"] = state["torch"][:100]
    elif part == "cuda":
        state["cuda"] = ["not a tensor"]
    return state


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ("missing", "'numpy' stream is missing"),
        ("python", "'python' stream"),
        ("python-range", "outside 32 bits"),
        ("numpy", "'numpy' stream"),
        ("torch", "'torch' stream"),
        ("cuda", "'cuda' streams"),
    ],
)
def test_damaged_state_is_refused_and_nothing_is_restored(part: str, message: str) -> None:
    bad = _damaged(part)
    before = capture_process_streams()
    random.seed(5)  # move the streams, then check a failed restore leaves them exactly here
    moved = capture_process_streams()
    with pytest.raises(CorruptStateError, match=message):
        restore_process_streams(bad)
    assert digest_process_streams(capture_process_streams()) == digest_process_streams(moved)
    restore_process_streams(before)


def test_validate_rejects_non_dict() -> None:
    with pytest.raises(CorruptStateError, match="not a dict"):
        validate_process_streams([1, 2])


def test_fork_puts_streams_back_and_is_seeded() -> None:
    before = digest_process_streams(capture_process_streams())
    with fork_process_streams(seed=11):
        inside = _draw()
    assert digest_process_streams(capture_process_streams()) == before
    with fork_process_streams(seed=11):
        assert _draw() == inside

    def failing_block() -> None:
        with fork_process_streams():
            torch.rand(4)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing_block()
    assert digest_process_streams(capture_process_streams()) == before


def test_digest_changes_with_any_stream() -> None:
    base = digest_process_streams(capture_process_streams())
    for move in (random.random, np.random.rand, torch.rand):
        state = capture_process_streams()
        move() if move is not torch.rand else torch.rand(1)
        assert digest_process_streams(capture_process_streams()) != base
        restore_process_streams(state)
