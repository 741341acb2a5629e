"""The stream table in code (streams.py) and the fast save/restore of the process streams (_fastrng.py)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_repro import streams
from lightning_repro.data import fastrng as _fastrng
from lightning_repro.rng import capture_process_streams, digest_process_streams
from lightning_repro.seeding import derive_seed, mix_seed
from lightning_repro.streams import StreamKey

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_repro"
SEED = 1234
STREAM = StreamKey("train", 1)

# The keys each stream was derived with before streams.py existed (and that every checkpoint and digest
# depends on), written out literally: a change of keys in streams.py changes every run, so it must fail here.
_LITERAL = {
    "order": lambda: derive_seed(SEED, "order", "train", 1, 3, 2),
    "sample": lambda: derive_seed(SEED, "sample", "train", 1, 3, 2),
    "loader": lambda: derive_seed(SEED, "loader", 5, "train", 1, 3, 2),
    "worker": lambda: derive_seed(SEED, "worker", 5, "train", 1, 987654321, 3),
    "eval": lambda: derive_seed(SEED, "eval", "validate", 40),
    "rank": lambda: derive_seed(SEED, "rank", 5),
    "reseed": lambda: derive_seed(SEED, "reseed", 4, 2, 1, 3, 17),
    "pruning": lambda: derive_seed(SEED, "pruning", 3),
}


def test_each_stream_is_derived_with_the_keys_it_always_had() -> None:
    derived = {
        "order": streams.order_seed(SEED, STREAM, 3, 2),
        "sample": streams.sample_seed(SEED, STREAM, 3, 2),
        "loader": streams.loader_seed(SEED, 5, STREAM, 3, 2),
        "worker": streams.worker_seed(SEED, 5, STREAM, 987654321, 3),
        "eval": streams.eval_seed(SEED, "validate", 40),
        "rank": streams.rank_seed(SEED, 5),
        "reseed": streams.reseed_after_topology_change(SEED, 4, 2, 1, 3, 17),
        "pruning": streams.pruning_seed(SEED, 3),
    }
    assert derived == {name: literal() for name, literal in _LITERAL.items()}
    assert len(set(derived.values())) == len(derived)  # and no two streams share a seed


def test_per_sample_streams_mix_the_pass_seed_as_before() -> None:
    base = streams.sample_seed(SEED, STREAM, 0, 0)
    assert streams.item_seed(base, 7) == mix_seed(base, 7)
    assert streams.batch_seed(base, 7) == mix_seed(base ^ 0x2545F4914F6CDD1D, 7)
    assert streams.collate_seed(base, 7) == mix_seed(base ^ 0x5DEECE66D_C0FFEE, 7)
    assert streams.own_generator_seed(base, 99) == mix_seed(base, 99)
    assert len({streams.item_seed(base, 7), streams.batch_seed(base, 7), streams.collate_seed(base, 7)}) == 3


@given(
    base=st.integers(0, 2**64 - 1),
    indices=st.lists(st.integers(0, 2**40) | st.integers(-5, -1) | st.tuples(st.integers(), st.text()), max_size=20),
)
def test_the_inlined_mixer_equals_the_reference(base: int, indices: list[Any]) -> None:
    assert streams.item_seeds(base, indices) == [streams.item_seed(base, i) for i in indices]
    ints = [i for i in indices if isinstance(i, int)]
    assert streams.item_seeds(base, ints) == [mix_seed(base, i) for i in ints]


def test_numpy_integer_indices_are_keyed_like_ints() -> None:
    assert streams.item_seeds(5, [np.int64(3), np.int32(4)]) == [mix_seed(5, 3), mix_seed(5, 4)]
    assert streams.index_int((1, "a")) == streams.index_int((1, "a")) != streams.index_int((1, "b"))


def _sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(PACKAGE.glob("*.py"))}


def test_only_streams_py_derives_stream_seeds() -> None:
    calls = {name for name, text in _sources().items() if re.search(r"\bderive_seed\(", text)}
    assert calls == {"seeding.py", "streams.py"}  # seeding.py defines it (and its doctest)


def test_the_mixer_is_inlined_in_one_place() -> None:
    constant = "0xBF58476D1CE4E5B9"  # SplitMix64's first multiplier
    holders = {name: text.count(constant) for name, text in _sources().items() if constant in text}
    assert holders == {"seeding.py": 1, "streams.py": 1}


# ------------------------------------------------------------------ the fast path of the process streams
@pytest.mark.parametrize("raw", [True, False], ids=["raw-copy", "public-api"])
def test_fast_capture_and_restore_round_trip(raw: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if raw:
        assert _fastrng.NUMPY_RAW is not None  # the layout was found and checked on this numpy
    else:
        monkeypatch.setattr(_fastrng, "NUMPY_RAW", None)
    np.random.seed(3)
    np.random.randn()  # a cached Box-Muller value
    random.gauss(0, 1)
    before = digest_process_streams(capture_process_streams())
    saved = _fastrng.capture_fast()
    _fastrng.seed_sample(2**63 + 5)
    drawn = (random.random(), float(np.random.randn()), float(torch.rand(())))
    assert digest_process_streams(capture_process_streams()) != before
    _fastrng.restore_fast(saved)
    assert digest_process_streams(capture_process_streams()) == before
    _fastrng.seed_sample(2**63 + 5)
    assert (random.random(), float(np.random.randn()), float(torch.rand(()))) == drawn


@pytest.mark.parametrize(
    ("value", "wanted"),
    [(None, True), ("", True), ("1", True), ("on", True), ("0", False), (" False ", False), ("no", False)],
)
def test_the_numpy_raw_switch_values(value: str | None, wanted: bool) -> None:
    assert _fastrng.numpy_raw_wanted(value) is wanted


def test_a_bad_numpy_raw_switch_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"`LIGHTNING_REPRO_NUMPY_RAW` must be 1 or 0.*got 'maybe'"):
        _fastrng.numpy_raw_wanted("maybe")


def test_the_numpy_raw_switch_is_honoured_in_a_fresh_interpreter() -> None:
    code = (
        "import numpy as np\n"
        "from lightning_repro.data import fastrng as _fastrng\n"
        "np.random.seed(1); np.random.randn()\n"
        "saved = _fastrng.capture_fast(); _fastrng.seed_sample(9); np.random.randn(); _fastrng.restore_fast(saved)\n"
        "print(_fastrng.NUMPY_RAW is None, type(saved[1][0]).__name__, repr(float(np.random.randn())))\n"
    )
    env = {**os.environ, _fastrng.NUMPY_RAW_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    off, kind, draw = out.split()
    assert (off, kind) == ("True", "str")  # numpy's public state ("MT19937", ...), not raw bytes
    assert _fastrng.NUMPY_RAW is not None  # here: the raw path
    assert type(_fastrng._numpy_capture()[0]) is bytes
    np.random.seed(1)
    np.random.randn()
    assert float(draw) == float(np.random.randn())  # the child's numpy stream was put back exactly
