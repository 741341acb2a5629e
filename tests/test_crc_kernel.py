"""The compiled CRC-32 of the step trace's batch digest: the value of ``zlib.crc32``, on every path and alignment."""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import pytest
import torch

from lightning_repro.checkpoint.hashing import NATIVE
from lightning_repro.trace import digest

needs_kernel = pytest.mark.skipif(
    NATIVE is None or not hasattr(NATIVE, "crc32"), reason="the compiled kernels are not built here"
)


def _bytes(n: int) -> bytes:
    return b"".join(hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n // 32 + 1))[:n]


@needs_kernel
@pytest.mark.parametrize("length", [0, 1, 15, 63, 64, 65, 79, 80, 127, 128, 1000, 4096, 65536 + 13, 393216])
@pytest.mark.parametrize("offset", [0, 1, 7])
@pytest.mark.parametrize("value", [0, 1, 0xFFFFFFFF, 0x12345678])
def test_the_kernel_continues_zlib(length: int, offset: int, value: int) -> None:
    data = _bytes(length + offset)[offset:]
    crc, used = NATIVE.crc32(data, value)
    assert used % 16 == 0
    assert used <= length
    if length >= 64 and NATIVE.crc32(bytes(64))[1]:  # a CPU with PCLMULQDQ: the kernel does all but the tail
        assert used > length - 16
    assert zlib.crc32(data[used:], crc) == zlib.crc32(data, value)


@needs_kernel
def test_the_kernel_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="CRC-32"):
        NATIVE.crc32(b"x" * 64, 2**32)
    with pytest.raises(TypeError):
        NATIVE.crc32()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16, torch.bool])
@pytest.mark.parametrize("shape", [(32, 3, 32, 32), (16385,), (5, 4099)])
def test_the_trace_digest_of_a_tensor_is_zlibs_crc(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    tensor = (torch.rand(shape, generator=g) * 100).to(dtype)
    raw = np.ascontiguousarray(tensor.numpy())
    assert digest._crc32(raw) == zlib.crc32(raw)
    assert digest._crc32(raw[1:]) == zlib.crc32(np.ascontiguousarray(raw[1:]))
