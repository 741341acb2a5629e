"""The compiled checksum kernel (``lightning_repro.checkpoint._rowsums``) gives bitwise the torch path's checksums.

Reference: :func:`~lightning_repro.checkpoint.hashing.row_checksums` with the kernel off (``torch.mv`` of the int64
rows). Compared for every kernel this CPU runs (AVX-512, AVX2, plain C) over shapes, dtypes, storage offsets (rows
that start anywhere in memory) and tails shorter than a row; and end to end: a checkpoint's restore digests with the
kernel and without it (``LIGHTNING_REPRO_NATIVE=0``) in fresh processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import runner
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_seedkernel import _compiler

from lightning_repro.checkpoint import hashing
from lightning_repro.checkpoint.verify import CHECKSUMMED

_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8,
    torch.bool, torch.complex64,
)  # fmt: skip


def _compiled() -> Any:
    try:
        from lightning_repro.checkpoint import _rowsums
    except ImportError:
        pytest.skip("lightning_repro.checkpoint._rowsums is not built here (no C compiler where it was installed)")
    return _rowsums


class _Kernel:
    """``hashing.NATIVE`` with one of the compiled kernels chosen (index into ``kernels()``)."""

    def __init__(self, compiled: Any, index: int) -> None:
        self.compiled, self.index = compiled, index

    def checksums(self, src: Any, out: Any) -> None:
        self.compiled.checksums(src, out, self.index)

    def kernels(self) -> list[str]:
        return list(self.compiled.kernels()[: self.index + 1])


@pytest.fixture
def compiled() -> Any:
    return _compiled()


def _torch_path(tensor: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    with mock.patch.object(hashing, "NATIVE", None):
        return hashing.row_checksums(tensor)


def _random(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaN payloads, negative zeros, subnormals and all), bools 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g).view(dtype)


def test_the_kernel_is_built_and_used_where_a_c_compiler_is() -> None:
    if _compiler() is None or os.environ.get("LIGHTNING_REPRO_NATIVE"):
        pytest.skip("torch computes the checksums here: no C compiler, or LIGHTNING_REPRO_NATIVE is set")
    assert hashing.NATIVE is not None, "a C compiler is here, but lightning_repro.checkpoint._rowsums was not built"


def test_the_best_kernel_of_this_cpu_is_chosen(compiled: Any) -> None:
    names = compiled.kernels()
    assert names[0] == "scalar"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo here to read the CPU's features from")
    expected = ["scalar"]
    if "avx2" in flags and os.uname().machine == "x86_64":
        expected.append("avx2")
        if {"avx512f", "avx512dq"} <= flags:
            expected.append("avx512")
    assert names == expected


@given(
    dtype=st.sampled_from(_DTYPES),
    rows=st.integers(0, 3),
    tail=st.integers(0, 4100),
    offset=st.integers(0, 9),
    strided=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_every_kernel_gives_the_checksums_of_torch(
    dtype: torch.dtype, rows: int, tail: int, offset: int, strided: bool, seed: int
) -> None:
    """Any dtype, a whole number of rows and a tail (bytes), a view ``offset`` elements into its storage."""
    compiled = _compiled()
    size = torch.empty(0, dtype=dtype).element_size()
    numel = (rows * 4096 + tail) // size
    base = _random(dtype, offset + numel * (2 if strided else 1), seed)
    tensor = base[offset::2] if strided else base[offset:]  # strided: not contiguous, copied first
    expected = _torch_path(tensor)
    assert expected[0].numel() == numel * size // 4096
    for index in range(len(compiled.kernels())):
        with mock.patch.object(hashing, "NATIVE", _Kernel(compiled, index)):
            sums, rest = hashing.row_checksums(tensor)
        assert sums.dtype == torch.int64
        assert torch.equal(sums, expected[0]), compiled.kernels()[index]
        assert rest == expected[1]


@pytest.mark.parametrize("word", [-1, -(2**63), 2**63 - 1, 1, 0], ids=["ones", "min", "max", "one", "zero"])
def test_products_wrap_as_torch_s(compiled: Any, word: int) -> None:
    """Rows of one word repeated: every product and every partial sum wraps modulo 2**64."""
    words = torch.full((3 * 512,), word, dtype=torch.int64)
    expected = _torch_path(words)[0]
    for index in range(len(compiled.kernels())):
        out = torch.empty(3, dtype=torch.int64)
        compiled.checksums(words.numpy(), out.numpy(), index)
        assert torch.equal(out, expected), compiled.kernels()[index]


def test_one_changed_bit_changes_its_row_in_every_kernel(compiled: Any) -> None:
    values = _random(torch.float32, 4 * 1024, 3)
    sums = _torch_path(values)[0]
    flipped = values.clone()
    flipped.view(torch.int32)[2 * 1024 + 77] ^= 1 << 31  # a sign: one bit of row 2
    for index in range(len(compiled.kernels())):
        out = torch.empty(4, dtype=torch.int64)
        compiled.checksums(flipped.view(torch.uint8).numpy(), out.numpy(), index)
        assert [bool(a != b) for a, b in zip(out, sums, strict=True)] == [False, False, True, False]


def test_bad_buffers_are_refused_with_a_clear_error(compiled: Any) -> None:
    out = torch.empty(1, dtype=torch.int64).numpy()
    with pytest.raises(ValueError, match=r"`src` must hold whole rows of 4096 bytes, got 4095 bytes"):
        compiled.checksums(bytes(4095), out)
    with pytest.raises(ValueError, match=r"`out` must hold 16 bytes \(8 per row of `src`\), got 8"):
        compiled.checksums(bytes(8192), out)
    with pytest.raises(ValueError, match=r"`kernel` must index kernels\(\) \(\d here\), got 3"):
        compiled.checksums(bytes(4096), out, 3)
    with pytest.raises(BufferError):
        compiled.checksums(bytes(4096), bytes(8))  # `out` not writable
    compiled.checksums(bytes(4096), out, -1)
    assert int(out[0]) == 0


def test_a_kernel_that_disagrees_with_torch_is_not_used(monkeypatch: pytest.MonkeyPatch, compiled: Any) -> None:
    real = compiled.checksums

    def wrong(src: Any, out: Any, kernel: int = -1) -> None:
        real(src, out, kernel)
        if kernel == len(compiled.kernels()) - 1:
            out[0] ^= 1

    monkeypatch.setattr(compiled, "checksums", wrong)
    assert hashing.native_checksums() is None
    monkeypatch.setattr(compiled, "checksums", real)
    assert hashing.native_checksums() is compiled


def test_the_switch_turns_the_kernel_off_and_a_bad_value_names_the_variable() -> None:
    assert hashing.native_checksums("0") is None
    assert hashing.native_checksums("off") is None
    with pytest.raises(ValueError, match=r"`LIGHTNING_REPRO_NATIVE` must be 1 or 0.*got 'fast'"):
        hashing.native_checksums("fast")


def test_doctor_says_whether_the_kernel_is_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_repro.cli import doctor

    row = {f.name: f for f in doctor.audit_environment(doctor.collect_environment())}["checksum kernel"]
    assert row.status == "ok"  # speed only: the values are the same either way
    assert row.value.startswith("in use" if hashing.NATIVE is not None else "not")
    monkeypatch.setattr(hashing, "NATIVE", None)
    monkeypatch.setenv("LIGHTNING_REPRO_NATIVE", "0")
    assert hashing.checksum_status() == "off (LIGHTNING_REPRO_NATIVE=0): torch, same values, slower"


@pytest.mark.slow
def test_a_checkpoint_s_digests_are_the_same_with_the_kernel_off(tmp_path: Path) -> None:
    """Fresh processes: a model with a 64 KiB weight (and its Adam state) saved with the kernel and without it."""
    if hashing.NATIVE is None:
        pytest.skip("the checksum kernel is not in use here")
    cfg: dict[str, Any] = {"dim": 1024, "max_epochs": 1, "val": "off"}
    digests = {}
    for name, env in (("native", None), ("torch", {"LIGHTNING_REPRO_NATIVE": "0"})):
        out = tmp_path / name
        result = runner.run({**cfg, "out": str(out), "save_at_end": str(out / "end.ckpt")}, env=env)
        entry = torch.load(out / "end.ckpt", weights_only=True)["callbacks"]["DeterminismCallback"]
        digests[name] = (entry["ranks"][0]["restore_sha256"], result["params"])
    assert digests["native"][0]["parameters"].startswith(CHECKSUMMED)
    assert digests["native"][0]["optimizer"].startswith(CHECKSUMMED)
    assert digests["native"] == digests["torch"]


@pytest.mark.parametrize("checksums", [False, True], ids=["bytes", "checksums"])
def test_a_tensor_of_one_element_seen_through_a_stride_is_digested_as_its_copy(checksums: bool) -> None:
    """``contiguous()`` keeps the stride of a 0- or 1-element view, and ``view(torch.uint8)`` refused it."""
    import hashlib

    base = torch.arange(4, dtype=torch.float32)
    for view in (base[1:2:2], base[0:0:2], base.view(2, 2)[:1, :1].t()):
        a, b = hashlib.sha256(), hashlib.sha256()
        hashing.feed(a, view, checksums=checksums)
        hashing.feed(b, view.clone(memory_format=torch.contiguous_format), checksums=checksums)
        assert a.hexdigest() == b.hexdigest()
        for sums, rest in (_torch_path(view), hashing.row_checksums(view)):  # without the kernel, and with it
            assert sums.numel() == 0
            assert rest == view.clone().numpy().tobytes()
