"""torch's generator written in place by the seeding kernel (``lightning_repro.data.torchraw``, ``_fastrng.TORCH_RAW``).

Reference: torch's own calls. ``manual_seed(z)`` read back with ``get_state()``, ``initial_seed()`` and the next
draws (a refill of the 624 words included); ``get_state()``/``set_state()`` for a state taken and put back, with
both cached normals (float and double) set. A layout that does not check out is not used.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_repro.data import fastrng as _fastrng
from lightning_repro.data import torchraw
from lightning_repro.seeding import fold_seed32

_EDGES = (0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1)
_seeds = st.one_of(st.sampled_from(_EDGES), st.integers(0, 2**64 - 1))
_gen = torch.default_generator


@pytest.fixture
def kernel() -> Iterator[Any]:
    """The kernel as ``_fastrng`` uses it, torch's engine configured; every stream put back afterwards."""
    if not _fastrng.TORCH_RAW:
        pytest.skip(f"torch's generator is not written in place here: {_fastrng.native_status()}")
    saved = _fastrng.capture_fast(), _gen.get_state()
    yield _fastrng.NATIVE
    _fastrng.restore_fast(saved[0])
    _gen.set_state(saved[1])


def _manual_seed(z: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_state()`` after ``manual_seed(z)``, and the 700 draws after it (the words refilled once)."""
    _gen.manual_seed(z)
    return _gen.get_state(), torch.rand(700)


def _normals_cached() -> None:
    torchraw._cached_normals()
    state = _gen.get_state().numpy()
    assert state[5040] == 1  # the double's normal_is_valid
    assert state[5052] == 1  # the float's valid flag


def _as_manual_seed(z: int, expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(_gen.get_state(), expected[0]), z
    assert _gen.initial_seed() == z
    assert torch.equal(torch.rand(700), expected[1]), z


def test_torch_is_written_in_place_wherever_the_kernel_is_used_on_linux() -> None:
    if _fastrng.NATIVE is None or not sys.platform.startswith("linux"):
        pytest.skip(f"no kernel or not Linux here: {_fastrng.native_status()}")
    assert _fastrng.TORCH_RAW, "the kernel is in use on Linux, but torch's generator was not found or did not check"
    assert _fastrng.native_status() == "in use (python, numpy and torch seeded a batch at a time, written in place)"
    assert len(_fastrng.NATIVE.capture()) == 5016 + _fastrng.NATIVE.TORCH_RAW_BYTES


_fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)


@_fixture_ok
@given(seeds=st.lists(_seeds, max_size=40))
def test_put_raw_leaves_every_stream_as_the_library_calls(kernel: Any, seeds: list[int]) -> None:
    block = kernel.states_raw(seeds)
    size = kernel.SAMPLE_RAW_BYTES
    assert len(block) == size * len(seeds)
    plain = kernel.states(seeds)
    assert [block[k * size : k * size + 5000] for k in range(len(seeds))] == [
        plain[k * 5000 : (k + 1) * 5000] for k in range(len(seeds))
    ]  # python's and numpy's as states() makes them
    for k, z in enumerate(seeds):
        random.seed(z)
        np.random.seed(fold_seed32(z))
        streams = _fastrng._raw_streams()
        expected = _manual_seed(z)
        random.gauss(0, 1)
        np.random.randn()
        _normals_cached()  # both of torch's cached normals set: the write must clear them, as manual_seed does
        kernel.put_raw(block, k)
        assert _fastrng._raw_streams() == streams, z
        _as_manual_seed(z, expected)


def test_every_batch_length_gives_each_sample_its_one_sample_states(kernel: Any) -> None:
    seeds = [((k + 3) * 0x9E3779B97F4A7C15 + (k << 40)) % 2**64 for k in range(41)]
    seeds[5], seeds[17] = 7, 2**32 + 1
    alone = [kernel.states_raw([z]) for z in seeds]
    for n in range(len(seeds) + 1):
        block = kernel.states_raw(seeds[:n])
        size = kernel.SAMPLE_RAW_BYTES
        assert [block[k * size : (k + 1) * size] for k in range(n)] == alone[:n], n


@_fixture_ok
@given(z=_seeds)
def test_seed_raw_and_seed_sample_are_the_library_calls(kernel: Any, z: int) -> None:
    random.seed(z)
    np.random.seed(fold_seed32(z))
    streams = _fastrng._raw_streams()
    expected = _manual_seed(z)
    for seed in (kernel.seed_raw, _fastrng.seed_sample):
        _normals_cached()
        np.random.randn()
        seed(z)
        assert _fastrng._raw_streams() == streams
        _as_manual_seed(z, expected)


@pytest.mark.parametrize("streams", [1, 2, 3, 4, 5])
def test_put_raw_writes_only_the_streams_asked(kernel: Any, streams: int) -> None:
    block = kernel.states_raw([7, 8])
    random.seed(1)
    np.random.seed(1)
    _gen.manual_seed(1)
    torch.rand(5)
    before = _fastrng._raw_streams(), _gen.get_state()
    kernel.put_raw(block, 1, streams)
    after = _fastrng._raw_streams(), _gen.get_state()
    random.seed(8)
    np.random.seed(fold_seed32(8))
    seeded = _fastrng._raw_streams(), _manual_seed(8)[0]
    python, numpy = slice(0, 2500), slice(2500, None)
    assert after[0][python] == (seeded[0] if streams & 1 else before[0])[python]
    assert after[0][numpy] == (seeded[0] if streams & 2 else before[0])[numpy]
    assert torch.equal(after[1], seeded[1] if streams & 4 else before[1])


def test_capture_and_restore_give_back_torch_with_its_cached_normals(kernel: Any) -> None:
    _gen.manual_seed(123)
    torch.rand(650)  # past a refill
    _normals_cached()
    state = _gen.get_state()
    taken = _fastrng.capture_fast()
    assert taken[2] is None  # no get_state() tensor: torch's engine is in the kernel's bytes
    expected = torch.randn(1, dtype=torch.float64), torch.rand(700), torch.randn(40)
    _fastrng.seed_sample(99)
    torch.rand(3)
    _fastrng.restore_fast(taken)
    assert torch.equal(_gen.get_state(), state)
    again = torch.randn(1, dtype=torch.float64), torch.rand(700), torch.randn(40)
    assert all(torch.equal(a, b) for a, b in zip(again, expected, strict=True))


def test_bad_input_and_an_unconfigured_torch_are_refused_and_write_nothing(kernel: Any) -> None:
    block = kernel.states_raw([1, 2])
    with pytest.raises(ValueError, match=r"streams must be a mask of 1 \(python\), 2 \(numpy\) and 4 \(torch\), got 8"):
        kernel.put_raw(block, 0, 8)
    with pytest.raises(IndexError, match="sample 2 is not in states of 15008 bytes"):
        kernel.put_raw(block, 2)
    with pytest.raises(IndexError, match="is not in states of 10000 bytes"):
        kernel.put_raw(kernel.states([1, 2]), 0)  # the other form
    with pytest.raises(TypeError, match="takes 1 argument"):
        kernel.states_raw([1], None)
    taken = kernel.capture()
    before = _fastrng._raw_streams(), _gen.get_state()
    kernel.configure_torch(0)
    try:
        assert len(kernel.capture()) == 5016  # python's and numpy's only
        with pytest.raises(RuntimeError, match="configure_torch"):
            kernel.put_raw(block, 0)
        with pytest.raises(RuntimeError, match="configure_torch"):
            kernel.seed_raw(5)
        with pytest.raises(RuntimeError, match="configure_torch\\(\\) unset it"):
            kernel.restore(taken)
        assert _fastrng._raw_streams() == before[0]
        assert torch.equal(_gen.get_state(), before[1])
    finally:
        address = torchraw.engine_address()
        assert address is not None
        kernel.configure_torch(address)
    kernel.put_raw(block, 0, 4)
    assert _gen.initial_seed() == 1


def test_a_layout_that_does_not_check_out_is_not_used(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part of the check can fail: then the kernel is left without torch, and get_state/set_state are used."""
    seeds = _fastrng._KERNEL_CHECK_SEEDS
    address = torchraw.engine_address()
    assert address is not None
    try:
        monkeypatch.setattr(torchraw, "engine_address", lambda: address + 4)  # the words one field off
        assert not torchraw.kernel_agrees(kernel, seeds)
        assert len(kernel.capture()) == 5016
        monkeypatch.setattr(torchraw, "engine_address", lambda: None)
        assert not torchraw.kernel_agrees(kernel, seeds)
        monkeypatch.undo()

        def stale_normals(states: bytes, k: int, streams: int = 7) -> None:
            put_raw(states, k, streams)
            torchraw._cached_normals()  # as if the write left a cached normal behind

        put_raw = kernel.put_raw
        monkeypatch.setattr(kernel, "put_raw", stale_normals)
        assert not torchraw.kernel_agrees(kernel, seeds)
        monkeypatch.undo()
        read = torchraw._read

        def flagless(address: int, size: int) -> bytes | None:  # the cached normals' flags not where expected
            data = read(address, size)
            return bytes(size) if data is not None and size == torchraw._RAW_SIZE - torchraw._ENGINE else data

        monkeypatch.setattr(torchraw, "_read", flagless)
        assert torchraw.engine_address() is None  # found by its words, refused before anything is written
        monkeypatch.setattr(torchraw, "_read", lambda address, size: None)  # /proc/self/mem unreadable
        assert torchraw.engine_address() is None
        monkeypatch.undo()
        assert not _fastrng.torch_raw(kernel, "0")
        with pytest.raises(ValueError, match=r"`LIGHTNING_REPRO_TORCH_RAW` must be 1 or 0.*got 'maybe'"):
            _fastrng.torch_raw(kernel, "maybe")
        assert not _fastrng.torch_raw(None)
    finally:
        monkeypatch.undo()
        assert torchraw.kernel_agrees(kernel, seeds)  # configured again
    assert len(kernel.capture()) == 5016 + kernel.TORCH_RAW_BYTES


def test_an_unreadable_address_is_none_not_a_crash() -> None:
    assert torchraw._read(8, 16) is None  # the first page is never mapped
    assert torchraw._read(id(_gen), 24) is not None


def test_the_switch_turns_torch_raw_off_in_a_fresh_process_with_the_same_values() -> None:
    """``LIGHTNING_REPRO_TORCH_RAW=0``: torch through set_state/manual_seed; a keyed batch draws the same values."""
    code = (
        "import torch\n"
        "from lightning_repro.data import fastrng, usage\n"
        "class D:\n"
        "    def __getitem__(self, i): return torch.rand(3).tolist() + [torch.randn(1, dtype=torch.float64).item()]\n"
        "seeds = fastrng.item_seeds(2**63 + 1, list(range(20)))\n"
        "data, _ = usage.load_samples(D(), list(range(20)), seeds, usage.ALL)\n"
        "print(fastrng.TORCH_RAW, repr(data))\n"
    )
    out = {}
    for value in ("0", "1"):
        env = {**__import__("os").environ, torchraw.TORCH_RAW_ENV: value}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        out[value] = run.stdout.split(" ", 1)
    assert out["0"][0] == "False"
    if _fastrng.TORCH_RAW:
        assert out["1"][0] == "True"
    assert out["0"][1] == out["1"][1]
