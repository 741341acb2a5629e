"""Exact digests for the step trace (see :mod:`lightning_repro.trace.tracer`).

A tensor on the CPU is hashed with SHA-256 over its dtype, shape and raw bytes; from 64 KiB on, over the CRC-32
of its raw bytes instead (exact, a function of every bit; about 70 us with zlib instead of 200 us for a batch of 32
3x32x32 float32 images, about 15 us with the compiled kernel of ``checkpoint/_rowsums.c`` (carry-less
multiplication, checked against zlib at import, the same value): the trace must cost at most a few percent of a
step). A tensor on an accelerator is
reduced on the device to two integers of its bit patterns (:func:`device_checksum`), and the integers of a whole
record come to the host in one transfer (:func:`to_host`), where SHA-256 takes them. :func:`digest_streams`
hashes the process streams' states, read as raw memory where their layout was checked.
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import struct
import zlib
from array import array
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_repro.checkpoint.hashing import NATIVE as _ROWSUMS
from lightning_repro.data.fastrng import NATIVE, NUMPY_RAW, PYTHON_RAW, _py_inst, _torch_gen
from lightning_repro.shards import local_shard, shard_layout

__all__ = ["DIGEST_HEX", "Digest", "device_checksum", "digest_streams", "to_host"]

DIGEST_HEX = 32
"""Hex digits kept of each SHA-256 (128 bits)."""
_CRC_BYTES = 1 << 16
"""CPU tensors of at least this many bytes are digested through the CRC-32 of their bytes (70 us instead of
200 us for a batch of 32 3x32x32 float32 images); smaller ones feed their bytes to SHA-256."""
_BLOCK = 2500  # one Mersenne Twister's raw state: 624 words and an int (python: the int first)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def device_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of a tensor's bit patterns, computed where the tensor lives (no host sync).

    The elements, viewed as integers of their width, are summed plain and weighted by position (1, 2, ...),
    in int64 with wrap-around: exact, and the same whatever order the device sums in.

    Examples:
        >>> a = torch.tensor([1.0, 2.0])
        >>> torch.equal(device_checksum(a), device_checksum(a.clone())), torch.equal(
        ...     device_checksum(a), device_checksum(a.flip(0)))
        (True, False)
    """
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, ints.numel() + 1, device=ints.device, dtype=torch.int64)
    return torch.stack((ints.sum(), (ints * weights).sum()))


def _raw_bytes(value: torch.Tensor) -> Any:
    """A CPU tensor's elements as a C-contiguous numpy array over their raw bytes (complex: as real pairs).

    Few torch calls: right after a training step each one costs some 10 us here (cold caches), so the common case
    (contiguous, a dtype numpy has) is ``detach`` and ``numpy`` alone; its bytes are those of ``view(torch.uint8)``.
    """
    t = value.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    try:
        return t.numpy()
    except (TypeError, RuntimeError):  # bfloat16, float8...: no numpy dtype; a tensor with a conjugate or neg bit
        return t.reshape(-1).view(torch.uint8).numpy()  # (t is contiguous here)


def _checked_crc32() -> Any:
    """The compiled CRC-32 (``_rowsums.crc32``: carry-less multiplication), or None where it is missing or wrong.

    Checked once against ``zlib.crc32`` over lengths and starting values that take each of its paths (under 64
    bytes, whole 64-byte blocks, 16-byte tails, a rest for zlib), at odd offsets into memory.
    """
    crc32 = getattr(_ROWSUMS, "crc32", None)
    if crc32 is None:
        return None
    data = b"".join(hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(160))  # 5120 bytes
    for offset, length, value in ((0, 63, 0), (1, 64, 0), (3, 80, 7), (5, 4096, 0xFFFFFFFF), (0, 5117, 12345)):
        chunk = data[offset : offset + length]
        crc, used = crc32(chunk, value)
        if zlib.crc32(chunk[used:], crc) != zlib.crc32(chunk, value):
            return None
    return crc32


_CRC32 = _checked_crc32()


def _crc32(raw: Any) -> int:
    """``zlib.crc32`` of a C-contiguous numpy array's bytes: the compiled kernel's where it is in use (same value)."""
    if _CRC32 is None:
        return zlib.crc32(raw)
    crc, used = _CRC32(raw)
    return crc if used == raw.nbytes else zlib.crc32(memoryview(raw).cast("B")[used:], crc)


class Digest:
    """SHA-256 over a structure of tensors and plain values; device tensors are reduced by :func:`device_checksum`.

    The device checksums are kept on the device until :meth:`hexdigest`, which takes the host values the record
    fetched in one transfer.
    """

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.device: list[torch.Tensor] = []

    def add(self, value: Any) -> None:
        """Feed ``value`` (a tensor, or nested plain values) into the digest."""
        h = self.h
        if isinstance(value, torch.Tensor):
            layout = shard_layout(value)
            if layout is not None:  # a DTensor: its layout, then this rank's local shard (no gather)
                h.update(f"S{layout}".encode())
                value = local_shard(value)
            h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
            if value.is_cpu:
                raw = _raw_bytes(value)
                # a large tensor (a batch, a weight matrix) contributes the CRC-32 of its bytes: 3x cheaper
                h.update(struct.pack("<I", _crc32(raw)) if raw.nbytes >= _CRC_BYTES else raw.tobytes())
            else:
                self.device.append(device_checksum(value))
        elif isinstance(value, Mapping):
            h.update(f"D{len(value)}".encode())
            for key in sorted(value, key=repr):
                self.add(key)
                self.add(value[key])
        elif isinstance(value, (list, tuple)):
            h.update(f"L{len(value)}".encode())
            for item in value:
                self.add(item)
        elif value is None or isinstance(value, (bool, int, float, str, bytes)):
            h.update(f"V{value!r}".encode())
        else:
            array = getattr(value, "__array__", None)  # numpy arrays and scalars
            if callable(array):
                self.add(torch.as_tensor(array()))
            else:  # an object: its type only (its repr may hold its address)
                h.update(f"O{type(value).__qualname__}".encode())

    def hexdigest(self, host: list[torch.Tensor]) -> str:
        """The hex digest, with the device checksums ``host`` (brought to the host in one transfer) fed last."""
        for values in host:
            self.h.update(values.numpy().tobytes())
        return self.h.hexdigest()[:DIGEST_HEX]


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Bring small int64 tensors to the host: one transfer for all those on a device."""
    on_device = [t for t in tensors if t.device.type != "cpu"]
    if not on_device:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in on_device]).cpu()
    host = iter(torch.split(flat, [t.numel() for t in on_device]))
    return [next(host) if t.device.type != "cpu" else t for t in tensors]


def _python_words() -> bytes:
    """The python Mersenne Twister as ``int32 index`` + ``624 x uint32`` (its memory layout), read raw when checked."""
    if PYTHON_RAW is not None:
        return ctypes.string_at(*PYTHON_RAW)
    _, words, _ = random.getstate()
    return struct.pack("<i", words[-1]) + array("I", words[:-1]).tobytes()


def _numpy_words() -> tuple[bytes, int, float]:
    """The numpy global Mersenne Twister as ``624 x uint32`` + ``int32 pos``, and its cached gaussian."""
    if NUMPY_RAW is not None:
        address, aug, size = NUMPY_RAW
        has_gauss, gauss = struct.unpack("<iid", ctypes.string_at(aug, 16))[0::2]
        return ctypes.string_at(address, size), has_gauss, gauss
    key: Any = np.random.get_state(legacy=True)
    words = np.ascontiguousarray(key[1], dtype=np.uint32).tobytes() + struct.pack("<i", key[2])
    return words, int(key[3]), float(key[4])


def digest_streams() -> str:
    """An exact digest of the process streams (python, numpy, torch CPU, CUDA) as they are now.

    The same information as :func:`~lightning_repro.rng.digest_process_streams` of a captured state (another hash
    value), at a fraction of the cost: python's and numpy's Mersenne Twisters are read as raw memory where their
    layout was checked (:mod:`lightning_repro.data.fastrng`), else through the public API, into the same bytes (the
    digest does not depend on ``LIGHTNING_REPRO_NUMPY_RAW`` / ``LIGHTNING_REPRO_PYTHON_RAW``).
    """
    h = hashlib.sha256()
    if NATIVE is not None:  # python's and numpy's raw states in one call (the kernel's layout: see fastrng)
        raw = NATIVE.capture()
        h.update(raw[:_BLOCK])
        h.update(repr(_py_inst.gauss_next).encode())  # type: ignore[attr-defined]
        h.update(raw[_BLOCK : 2 * _BLOCK])
        has_gauss, gauss = struct.unpack_from("<i4xd", raw, 2 * _BLOCK)
    else:
        h.update(_python_words())
        h.update(repr(random.getstate()[2] if PYTHON_RAW is None else _py_inst.gauss_next).encode())  # type: ignore[attr-defined]
        words, has_gauss, gauss = _numpy_words()
        h.update(words)
    h.update(struct.pack("<id", has_gauss, gauss if has_gauss else 0.0))
    h.update(_torch_gen.get_state().numpy().data)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # (is_available() too: it costs 15 us cold)
        for state in torch.cuda.get_rng_state_all():
            h.update(state.numpy().data)
    return h.hexdigest()[:DIGEST_HEX]
