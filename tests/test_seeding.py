from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_repro
from lightning_repro import NondeterminismWarning, derive_seed, seed_everything, seeding
from lightning_repro.seeding import MAX_SEED, mix_seed, set_deterministic_flags, validate_seed

seeds = st.integers(min_value=0, max_value=MAX_SEED)
keys = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=8), st.binary(max_size=8))


def test_public_api_is_complete_and_sorted() -> None:
    exported = lightning_repro.__all__
    assert exported == sorted(exported)
    for name in exported:
        assert hasattr(lightning_repro, name), name
    for name in ("DeterminismCallback", "seed_everything", "derive_seed", "ReproError"):
        assert name in exported


# Known answers: every stream of every run and checkpoint hangs on these; a change of the derivation (or a
# dependence on the process, such as PYTHONHASHSEED) changes them.
KNOWN_SEEDS = [
    (0, (), 10082331977514642171),
    (1234, ("order", 0), 4924070660024483959),
    (1234, ("sample", 0, 3, 17), 2945005442103254278),
    (42, ("worker", 1, b"\x00\xff"), 8088510225615414565),
    (2**32 - 1, ("eval", "val", -5), 13161218205916657134),
    (7, ("rank", 1, True), 7889762065207746354),
]


@pytest.mark.parametrize(("seed", "key_list", "expected"), KNOWN_SEEDS)
def test_derive_seed_known_values(seed: int, key_list: tuple[int | str | bytes, ...], expected: int) -> None:
    assert derive_seed(seed, *key_list) == expected


@given(seeds, st.lists(keys, max_size=4))
def test_derive_seed_is_a_64_bit_function_of_the_key_values(seed: int, key_list: list[object]) -> None:
    value = derive_seed(seed, *key_list)  # type: ignore[arg-type]
    assert 0 <= value < 2**64
    # a numpy integer key names the same stream as the int of the same value (indices come as both)
    as_numpy = [np.int64(k) if type(k) is int and -(2**63) <= k < 2**63 else k for k in key_list]
    assert derive_seed(np.uint32(seed), *as_numpy) == value  # type: ignore[arg-type]


@given(seeds, st.lists(keys, min_size=1, max_size=3), st.lists(keys, min_size=1, max_size=3))
def test_derive_seed_separates_distinct_keys(seed: int, a: list[object], b: list[object]) -> None:
    if a != b:
        assert derive_seed(seed, *a) != derive_seed(seed, *b)  # type: ignore[arg-type]


def test_derive_seed_no_collisions_over_many_streams() -> None:
    """No two (epoch, sample) streams of a large run share a seed; and no arithmetic aliasing."""
    values = {derive_seed(7, "sample", 0, epoch, index) for epoch in range(20) for index in range(5000)}
    assert len(values) == 20 * 5000
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert derive_seed(1, "12") != derive_seed(1, 12)
    assert derive_seed(1, "a", "bc") != derive_seed(1, "ab", "c")
    assert derive_seed(0, 1) != derive_seed(1, 0)


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=2**64 - 1), st.integers(min_value=0, max_value=2**40))
def test_mix_seed_stays_in_64_bits(base: int, index: int) -> None:
    assert 0 <= mix_seed(base, index) < 2**64


def test_mix_seed_has_no_collisions_over_indices() -> None:
    base = derive_seed(3, "sample")
    assert len({mix_seed(base, i) for i in range(200_000)}) == 200_000


@pytest.mark.parametrize("bad", [-1, 2**32, 10**20])
def test_seed_out_of_range_is_a_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match=r"`seed` must be in \[0, 2\*\*32 - 1\], got " + str(bad)):
        seed_everything(bad)
    with pytest.raises(ValueError, match="`seed`"):
        derive_seed(bad, "x")


@pytest.mark.parametrize("bad", [1.5, "42", None, True, [1]])
def test_seed_of_wrong_type_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="`seed` must be an int"):
        validate_seed(bad)


def test_derive_seed_rejects_unhashable_keys() -> None:
    with pytest.raises(TypeError, match="`keys`"):
        derive_seed(1, 1.5)  # type: ignore[arg-type]


def test_seed_everything_pins_all_process_streams() -> None:
    def draw() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    os.environ.pop("PL_GLOBAL_SEED", None)
    assert seed_everything(123) == 123
    first = draw()
    seed_everything(123)
    assert draw() == first
    seed_everything(124)
    assert draw() != first
    assert "PL_GLOBAL_SEED" not in os.environ  # no lasting change to os.environ


def test_deterministic_flags() -> None:
    set_deterministic_flags(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
    set_deterministic_flags("warn")
    assert torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.parametrize("bad", ["yes", 1, None, "WARN"])
def test_unknown_deterministic_value(bad: object) -> None:
    with pytest.raises(ValueError, match="`deterministic` must be True, False or 'warn'"):
        set_deterministic_flags(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, "random"])
def test_hash_seed_warning_once_and_environ_untouched(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    monkeypatch.setattr(seeding, "_INTERPRETER_HASH_SEED", value)
    monkeypatch.setattr(seeding, "_warned_hash_seed", set())
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    said = "is not set" if value is None else "is 'random'"  # set to "random", it is set: the warning says so
    with pytest.warns(NondeterminismWarning, match=f"PYTHONHASHSEED {said}: `hash"):
        seeding.check_hash_seed(99)
    assert "PYTHONHASHSEED" not in os.environ  # exported only while a run starts child processes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seeding.check_hash_seed(99)  # once per cause


def test_an_empty_hash_seed_is_taken_as_unset() -> None:
    """``PYTHONHASHSEED=`` (set, empty): CPython hashes at random. It was taken as a fixed seed: no warning, the
    empty value exported to the ranks and workers, and recorded in the manifest as a seed."""
    code = (
        "import sys, warnings; warnings.simplefilter('always')\n"
        "from lightning_repro import seeding, collect_manifest\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always'); seeding.check_hash_seed(5)\n"
        "print(sys.flags.hash_randomization, [str(w.message)[:26] for w in caught],"
        " collect_manifest()['environment']['pythonhashseed'])\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": ""}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[-2] == "1 ['PYTHONHASHSEED is not set:'] None", done.stdout


def test_any_fixed_hash_seed_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seeding, "_INTERPRETER_HASH_SEED", "0")
    monkeypatch.setattr(seeding, "_warned_hash_seed", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seeding.check_hash_seed(5)  # another value than the seed: hashing is fixed all the same


def test_export_hash_seed_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    undo = seeding.export_hash_seed(7)
    assert os.environ["PYTHONHASHSEED"] == "7"
    undo()
    assert "PYTHONHASHSEED" not in os.environ
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    undo = seeding.export_hash_seed(7)
    assert os.environ["PYTHONHASHSEED"] == "7"
    undo()
    assert os.environ["PYTHONHASHSEED"] == "random"
    monkeypatch.setenv("PYTHONHASHSEED", "")  # empty: CPython hashes at random, as unset (it was taken as fixed)
    undo = seeding.export_hash_seed(7)
    assert os.environ["PYTHONHASHSEED"] == "7"
    undo()
    assert os.environ["PYTHONHASHSEED"] == ""
    monkeypatch.setenv("PYTHONHASHSEED", "3")  # a fixed value the user chose: every child inherits it
    undo = seeding.export_hash_seed(7)
    assert os.environ["PYTHONHASHSEED"] == "3"
    undo()
    assert os.environ["PYTHONHASHSEED"] == "3"
