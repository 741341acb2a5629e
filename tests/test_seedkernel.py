"""The compiled seeding kernel (``lightning_repro.data._seedkernel``) gives bitwise the states of the library calls.

Reference: ``random.seed(z)`` and ``np.random.seed(fold_seed32(z))``, read back as raw memory (python's index and
624 words, numpy's 624 words and position, numpy's cached gaussian), and torch's ``manual_seed(z)`` read back with
``get_state()`` and ``initial_seed()``. Compared for many keys, for batches of every
size around the kernel's 16-sample passes (a pass, a partial pass, samples one at a time), and end to end: trained
weights with the kernel and without it (``LIGHTNING_REPRO_NATIVE=0``) in fresh processes.
"""

from __future__ import annotations

import os
import random
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import runner
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_repro.data import fastrng as _fastrng
from lightning_repro.seeding import fold_seed32

_EDGES = (0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1)
_seeds = st.one_of(st.sampled_from(_EDGES), st.integers(0, 2**64 - 1))


def _compiler() -> str | None:
    """The C compiler the build would use, when it and Python's headers are here (else the kernel cannot build)."""
    cc = (sysconfig.get_config_var("CC") or "").split()
    headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    return shutil.which(cc[0]) if cc and headers else None


@pytest.fixture
def kernel() -> Iterator[Any]:
    """The compiled module itself, configured (whether or not the import-time check let ``_fastrng`` use it)."""
    try:
        import lightning_repro.data._seedkernel as compiled
    except ImportError:
        pytest.skip(f"lightning_repro.data._seedkernel is not built here: {_why_not()}")
    assert _fastrng.PYTHON_RAW is not None
    assert _fastrng.NUMPY_RAW is not None
    saved = _fastrng.capture_fast()
    compiled.configure(_fastrng.PYTHON_RAW[0], _fastrng.NUMPY_RAW[0], _fastrng.NUMPY_RAW[1])
    yield compiled
    _fastrng.restore_fast(saved)


def _why_not() -> str:
    if os.environ.get(_fastrng.NATIVE_ENV):
        return f"{_fastrng.NATIVE_ENV}={os.environ[_fastrng.NATIVE_ENV]}"
    if _compiler() is None:
        return "no C compiler (or no Python headers) where lightning-repro was installed"
    return "not built or not checked"


def _library(z: int) -> bytes:
    random.seed(z)
    np.random.seed(fold_seed32(z))
    return _fastrng._raw_streams()


def test_the_kernel_is_built_and_used_where_a_c_compiler_is() -> None:
    if _compiler() is None or os.environ.get(_fastrng.NATIVE_ENV):
        pytest.skip(f"the library calls seed the streams here: {_why_not()}")
    assert _fastrng.NATIVE is not None, "a C compiler is here, but lightning_repro.data._seedkernel was not built"


_fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # `kernel` restores once


@_fixture_ok
@given(seeds=st.lists(_seeds, max_size=40))
def test_batched_states_are_those_of_the_library(kernel: Any, seeds: list[int]) -> None:
    block = kernel.states(seeds)
    assert len(block) == kernel.SAMPLE_BYTES * len(seeds)
    for k, z in enumerate(seeds):
        expected = _library(z)
        random.random()  # move both streams, so that put() has something to overwrite
        np.random.randn()
        kernel.put(block, k)
        assert _fastrng._raw_streams() == expected, (k, z)
        assert random.getstate()[1] == _library_state_python(z)


def test_every_batch_length_gives_each_sample_its_one_sample_states(kernel: Any) -> None:
    """The wide passes (16 lanes, the last one partly used) and the one-sample tail agree at every batch length."""
    seeds = [((k + 3) * 0x9E3779B97F4A7C15 + (k << 40)) % 2**64 for k in range(41)]
    seeds[5], seeds[17] = 7, 2**32 + 1  # one-word and two-word keys among them
    alone = [kernel.states([z]) for z in seeds]
    alone_torch = []
    for z in seeds:
        one = _fastrng.TorchStates(1)
        kernel.states([z], one.arrays)
        alone_torch.append(bytes(one.tensors[0].numpy()))
    for n in range(len(seeds) + 1):
        room = _fastrng.TorchStates(n)
        block = kernel.states(seeds[:n], room.arrays)
        size = kernel.SAMPLE_BYTES
        assert [block[k * size : (k + 1) * size] for k in range(n)] == alone[:n], n
        assert [bytes(t.numpy()) for t in room.tensors[:n]] == alone_torch[:n], n


def _library_state_python(z: int) -> tuple[int, ...]:
    state = random.getstate()
    random.seed(z)
    words: tuple[int, ...] = random.getstate()[1]
    random.setstate(state)
    return words


@_fixture_ok
@given(z=_seeds)
def test_one_sample_seeded_is_the_library(kernel: Any, z: int) -> None:
    expected = _library(z)
    random.random()
    np.random.randn()  # leaves a cached gaussian: seeding must clear it
    kernel.seed(z)
    assert _fastrng._raw_streams() == expected


@pytest.mark.parametrize("streams", [1, 2])
def test_put_writes_only_the_streams_asked(kernel: Any, streams: int) -> None:
    block = kernel.states([7, 8])
    random.seed(1)
    np.random.seed(1)
    before = _fastrng._raw_streams()
    kernel.put(block, 1, streams)
    after = _fastrng._raw_streams()
    seeded = _library(8)
    python, numpy = slice(0, 2500), slice(2500, None)
    assert after[python] == (seeded if streams == 1 else before)[python]
    assert after[numpy] == (seeded if streams == 2 else before)[numpy]


def _torch_after_manual_seed(z: int) -> tuple[Any, int]:
    generator = torch.default_generator
    saved = generator.get_state()
    generator.manual_seed(z)
    state = generator.get_state(), generator.initial_seed()
    generator.set_state(saved)
    return state


@_fixture_ok
@given(seeds=st.lists(_seeds, max_size=40))
def test_torch_states_are_those_of_manual_seed(kernel: Any, seeds: list[int]) -> None:
    """``set_state()`` of the kernel's torch states leaves torch's generator as ``manual_seed`` does."""
    generator = torch.default_generator
    saved = generator.get_state()
    room = _fastrng.TorchStates(len(seeds))
    try:
        assert kernel.states(seeds, room.arrays) == kernel.states(seeds)  # python's and numpy's unchanged
        for z, state in zip(seeds, room.tensors, strict=True):
            expected, initial = _torch_after_manual_seed(z)
            torch.rand(3)
            generator.set_state(state)
            assert torch.equal(generator.get_state(), expected), z
            assert generator.initial_seed() == initial == z
    finally:
        generator.set_state(saved)


def test_the_item_seeder_leaves_every_stream_as_seed_sample(kernel: Any) -> None:
    """Items of one block and of the next: python, numpy and torch as ``seed_sample`` of the item's seed."""
    from lightning_repro import streams

    seeder = _fastrng.ItemSeeder(2**63 + 11)
    for k in (0, 1, 31, 32, 33, 70, 5):
        random.gauss(0, 1)  # a cached gaussian that seeding must clear
        z = seeder.seed(k)
        assert z == streams.item_seed(2**63 + 11, k)
        ours = _fastrng._raw_streams(), random.gauss(0, 1), torch.get_rng_state(), torch.initial_seed()
        _fastrng.seed_sample(z)
        library = _fastrng._raw_streams(), random.gauss(0, 1), torch.get_rng_state(), torch.initial_seed()
        assert ours[0] == library[0], k
        assert ours[1] == library[1], k
        assert ours[3] == library[3] == z, k
        assert torch.equal(ours[2], library[2]), k


def test_torch_states_are_used_where_they_agree(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _fastrng.TORCH_KERNEL is (_fastrng.NATIVE is not None)  # torch 2.13's state format: they agree
    assert _fastrng.torch_kernel(kernel)
    assert not _fastrng.torch_kernel(None)

    def wrong(seeds: Any, buffers: Any = None) -> bytes:
        block = kernel_states(seeds, buffers)
        if buffers is not None:
            buffers[-1][24] ^= 1  # one bit of the first word of torch's last state
        return block  # type: ignore[no-any-return]

    kernel_states = kernel.states
    monkeypatch.setattr(kernel, "states", wrong)
    assert not _fastrng.torch_kernel(kernel)
    monkeypatch.setattr(_fastrng, "TORCH_KERNEL", False)
    assert _fastrng.take_torch_states(4) is None  # then torch is seeded through manual_seed


def test_the_kernel_drives_the_same_samples_as_the_library(kernel: Any) -> None:
    """``seed_sample`` and a keyed batch draw the same values with the kernel and without it."""
    seeds = [3, 2**40 + 5, 2**64 - 1]

    def draws() -> list[float]:
        return [random.random(), random.gauss(0, 1), float(np.random.randn()), float(np.random.rand())]

    for z in seeds:
        _fastrng.seed_sample(z)
        with_kernel = draws()
        random.seed(z)
        np.random.seed(fold_seed32(z))
        assert draws() == with_kernel


def test_bad_input_is_refused_with_a_clear_error(kernel: Any) -> None:
    with pytest.raises(OverflowError, match=r"a sample seed must be in \[0, 2\*\*64\), got -1"):
        kernel.states([1, -1])
    with pytest.raises(OverflowError, match=r"got 18446744073709551616"):
        kernel.seed(2**64)
    with pytest.raises(TypeError, match="a sample seed must be an int, got float"):
        kernel.states([1.5])
    with pytest.raises(TypeError, match="takes a sequence of ints"):
        kernel.states(5)
    block = kernel.states([1, 2])
    with pytest.raises(IndexError, match="sample 2 is not in states of 10000 bytes"):
        kernel.put(block, 2)
    with pytest.raises(IndexError, match="sample -1"):
        kernel.put(block, -1)
    with pytest.raises(IndexError, match="sample 0 is not in states of 3 bytes"):
        kernel.put(b"abc", 0)
    with pytest.raises(TypeError, match="takes the bytes states"):
        kernel.put(bytearray(block), 0)
    with pytest.raises(ValueError, match=r"streams must be a mask of 1 \(python\) and 2 \(numpy\), got 4"):
        kernel.put(block, 0, 4)
    room = _fastrng.TorchStates(2)
    with pytest.raises(ValueError, match="states\\(\\) got 1 torch buffers for 2 seeds"):
        kernel.states([1, 2], room.arrays[:1])
    with pytest.raises(ValueError, match="torch buffer 1 has 100 bytes, fewer than 5016"):
        kernel.states([1, 2], [room.arrays[0], bytearray(100)])
    with pytest.raises(BufferError, match="not writable"):
        kernel.states([1], [bytes(6000)])
    with pytest.raises(TypeError, match="takes 1 or 2 arguments"):
        kernel.states()


def test_an_unconfigured_kernel_writes_nothing(kernel: Any) -> None:
    before = _fastrng._raw_streams()
    kernel.configure(0, 0, 0)
    try:
        with pytest.raises(RuntimeError, match="configure"):
            kernel.seed(5)
        with pytest.raises(RuntimeError, match="configure"):
            kernel.put(kernel.states([5]), 0)
        assert _fastrng._raw_streams() == before
    finally:
        kernel.configure(_fastrng.PYTHON_RAW[0], _fastrng.NUMPY_RAW[0], _fastrng.NUMPY_RAW[1])  # type: ignore[index]
    kernel.seed(5)
    assert _fastrng._raw_streams() == _library(5)


def test_a_kernel_that_disagrees_with_the_library_is_not_used(monkeypatch: pytest.MonkeyPatch, kernel: Any) -> None:
    def wrong(seeds: Any) -> bytes:
        block = bytearray(kernel_states(seeds))
        block[100] ^= 1
        return bytes(block)

    kernel_states = kernel.states
    monkeypatch.setattr(kernel, "states", wrong)
    try:
        assert _fastrng.native_kernel() is None
    finally:
        monkeypatch.undo()
        kernel.configure(_fastrng.PYTHON_RAW[0], _fastrng.NUMPY_RAW[0], _fastrng.NUMPY_RAW[1])  # type: ignore[index]
    assert _fastrng.native_kernel() is kernel
    assert _fastrng.native_kernel("0") is None
    kernel.configure(_fastrng.PYTHON_RAW[0], _fastrng.NUMPY_RAW[0], _fastrng.NUMPY_RAW[1])  # type: ignore[index]


def test_a_bad_native_switch_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"`LIGHTNING_REPRO_NATIVE` must be 1 or 0.*got 'fast'"):
        _fastrng.native_kernel("fast")


@pytest.mark.slow
def test_trained_weights_are_those_of_the_library_calls(tmp_path: Path) -> None:
    """Every sample draws from python, numpy and torch; with workers and a mid-epoch resume, the kernel off."""
    if _fastrng.NATIVE is None:
        pytest.skip(f"the kernel is not in use here: {_why_not()}")
    cfg: dict[str, Any] = {"max_epochs": 2, "val": "off"}
    library = runner.run({**cfg, "out": str(tmp_path / "library")}, env={_fastrng.NATIVE_ENV: "0"})
    native = runner.run({**cfg, "out": str(tmp_path / "native")})
    assert native["params"] == library["params"]
    assert native["optimizer"] == library["optimizer"]
    resumed = runner.killed_then_resumed(cfg, tmp_path)
    assert resumed["params"] == library["params"]


def test_capture_and_restore_round_trip_every_cached_value(kernel: Any) -> None:
    random.seed(11)
    np.random.seed(12)
    random.gauss(0, 1)  # python's cached gaussian (kept by the caller) ...
    np.random.randn()  # ... and numpy's (in the RandomState, kept by the kernel)
    state = _fastrng.capture_fast()
    expected = [random.random(), random.gauss(0, 1), float(np.random.randn()), float(np.random.rand())]
    _fastrng.seed_sample(99)
    _fastrng.restore_fast(state)
    assert [random.random(), random.gauss(0, 1), float(np.random.randn()), float(np.random.rand())] == expected
    with pytest.raises(TypeError, match="takes the bytes capture"):
        kernel.restore(b"short")


_indices = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from((0, 1, -1, 2**63, 2**64 - 1, 2**64)))


@given(pass_seed=_seeds, indices=st.lists(_indices, max_size=20))
def test_item_seeds_are_those_of_streams(pass_seed: int, indices: list[int]) -> None:
    from lightning_repro import streams

    assert _fastrng.item_seeds(pass_seed, indices) == streams.item_seeds(pass_seed, indices)
    if _fastrng.NATIVE is not None:
        assert _fastrng.NATIVE.item_seeds(pass_seed, indices) == streams.item_seeds(pass_seed, indices)


def test_item_seeds_of_other_index_types_fall_back_to_streams(kernel: Any) -> None:
    from lightning_repro import streams

    indices = [np.int64(3), 4, True, "a", (1, 2)]
    with pytest.raises(TypeError, match=r"index 0 is a numpy\.int64, not an int"):
        kernel.item_seeds(7, indices)
    assert _fastrng.item_seeds(7, indices) == streams.item_seeds(7, indices)


def test_doctor_says_whether_the_kernel_is_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_repro.cli import doctor

    row = {f.name: f for f in doctor.audit_environment(doctor.collect_environment())}["seeding kernel"]
    assert row.status == "ok"  # speed only: the values are the same either way
    assert row.value.startswith("in use" if _fastrng.NATIVE is not None else "not")
    monkeypatch.setattr(_fastrng, "NATIVE", None)
    monkeypatch.setenv(_fastrng.NATIVE_ENV, "0")
    assert _fastrng.native_status() == "off (LIGHTNING_REPRO_NATIVE=0): library calls, same values, slower"
    monkeypatch.delenv(_fastrng.NATIVE_ENV)
    monkeypatch.setattr(_fastrng, "NUMPY_RAW", None)
    assert _fastrng.native_status().startswith("not used: a generator's raw layout was not found")


@given(key=st.integers(0, 2**64 - 1), start=st.integers(0, 100))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_an_item_seeder_seeds_each_item_as_seed_sample_does(key: int, start: int) -> None:
    """A stream's items seeded a block at a time (``ItemSeeder``) draw what ``seed_sample(item_seed(key, k))`` draws,
    across a block's edge and after a jump back (a restarted pass), with the kernel or without it."""
    import torch

    from lightning_repro import streams

    def draws() -> list[float]:
        return [random.random(), random.gauss(0, 1), float(np.random.randn()), float(torch.rand(()).item())]

    seeder = _fastrng.ItemSeeder(key)
    for k in [start, *range(start + 1, start + _fastrng.ItemSeeder.BLOCK + 3), start]:
        assert seeder.seed(k) == streams.item_seed(key, k)
        blocked = draws()
        _fastrng.seed_sample(streams.item_seed(key, k))
        assert draws() == blocked, k


class _Draws:
    """An iterable whose items are draws from python, numpy and torch, made while the item is produced."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[float, ...]]:
        for _ in range(self.n):
            yield random.random(), random.gauss(0, 1), float(np.random.randn()), float(torch.rand(()).item())


def test_a_workers_keyed_items_take_the_short_path_and_draw_as_seed_sample(
    kernel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a worker, the item iterator puts each item's states in place itself (``ItemSeeder.seed`` runs only to make
    a block: items 0, 32, 64 of 70, where the kernel makes torch's states too), and each item draws what
    ``seed_sample(item_seed(worker's key, k))`` gives."""
    from torch.utils.data._utils import worker as torch_worker

    from lightning_repro import streams
    from lightning_repro.data.streaming import KeyedIterable

    whole = _fastrng.NATIVE is not None and _fastrng.TORCH_KERNEL  # else every item through ItemSeeder.seed
    dataset = KeyedIterable(_Draws(70), owner=object(), keyed=True, batch_size=4)
    key = 2**63 + 5
    dataset.begin_pass(key, None)
    info = torch_worker.WorkerInfo(id=1, num_workers=2, seed=0, dataset=dataset)
    monkeypatch.setattr(torch_worker, "_worker_info", info)
    made: list[int] = []
    seed = _fastrng.ItemSeeder.seed

    def counted(self: Any, k: int) -> int:
        made.append(k)
        return seed(self, k)

    monkeypatch.setattr(_fastrng.ItemSeeder, "seed", counted)
    random.gauss(0, 1)  # a cached gaussian that the first item's seeding must clear
    iterator = iter(dataset)
    items = list(iterator)
    with pytest.raises(StopIteration):
        next(iterator)  # stays ended
    assert made == ([0, 32, 64] if whole else list(range(70)))
    monkeypatch.setattr(torch_worker, "_worker_info", None)
    worker_key = streams.worker_items_seed(key, 1)
    expected = []
    for k in range(70):
        _fastrng.seed_sample(streams.item_seed(worker_key, k))
        expected.append((random.random(), random.gauss(0, 1), float(np.random.randn()), float(torch.rand(()).item())))
    assert items == expected


def test_importing_the_package_leaves_the_global_streams_as_they_were() -> None:
    """The import-time checks of the kernel seed python's, numpy's and torch's global generators for the check
    seeds: each is put back. torch's was; python's and numpy's were left at the last check seed's state, in every
    process (a user's seeded draws after the import moved, an unseeded sweep drew the same values everywhere).
    Lightning's own import draws from python's (``rich.style`` takes 24 bits when rich is there): it is imported
    first in both processes."""
    import subprocess
    import sys

    code = (
        "import random, sys, numpy as np, torch\n"
        "random.seed(5); np.random.seed(6); torch.manual_seed(7); random.gauss(0, 1); np.random.standard_normal()\n"
        "import lightning.pytorch\n"
        "if sys.argv[1] == '1':\n"
        "    import lightning_repro\n"
        "print(random.random(), random.gauss(0, 1), np.random.rand(), np.random.standard_normal())\n"
        "print(torch.rand(1).item())\n"
    )
    said = [
        subprocess.run(
            [sys.executable, "-c", code, imported], capture_output=True, text=True, check=True, timeout=300
        ).stdout
        for imported in ("0", "1")
    ]
    assert said[0] == said[1], said
