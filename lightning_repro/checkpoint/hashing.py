"""One exact, type-tagged encoding of nested plain values and tensors, fed into a hash (entry seal, restore check)."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import torch

from lightning_repro.shards import local_shard, shard_layout

__all__ = ["CHECKSUM_BYTES", "feed", "row_checksums"]

CHECKSUM_BYTES = 1 << 16
"""With ``checksums=True``, tensors of at least this many bytes are fed through their :func:`row_checksums`."""
_ROW_WORDS = 512
"""8-byte words per row of :func:`row_checksums` (4 KiB: one int64 of checksum per 4 KiB of tensor)."""
_CHUNK_ROWS = 2048
"""Rows multiplied at once off the CPU (``torch.mv`` has no int64 kernel there): 8 MiB of temporary a chunk."""
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _weights(device: torch.device) -> torch.Tensor:
    """The odd 64-bit multipliers of a row's words (SplitMix64 of the column), as int64, on ``device``."""
    weights = _WEIGHTS.get(device)
    if weights is None:
        odd = [_splitmix64(column) | 1 for column in range(_ROW_WORDS)]
        signed = [value - (1 << 64) if value >= 1 << 63 else value for value in odd]
        weights = _WEIGHTS[device] = torch.tensor(signed, dtype=torch.int64, device=device)
    return weights


def row_checksums(tensor: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """A tensor's raw bytes reduced where the tensor lives: the checksum of each 4 KiB row, and the bytes after them.

    The bytes are read as int64 words, 512 to a row; a row's checksum is the sum of its words, each multiplied by an
    odd constant of its column, modulo 2**64 (exact integer arithmetic: the same whatever the device, its threads and
    the order they sum in). Every bit counts: a change confined to one word always changes its row's checksum. Returns
    the checksums (int64, on the CPU) and the last ``nbytes % 4096`` bytes as they are.

    Examples:
        >>> a = torch.arange(4096, dtype=torch.float32)
        >>> sums, rest = row_checksums(a)
        >>> tuple(sums.shape), rest
        ((4,), b'')
        >>> b = a.clone(); b[1000] = -b[1000]
        >>> torch.equal(row_checksums(b)[0], sums)
        False
    """
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    raw = flat.view(torch.uint8)
    if raw.storage_offset() % 8:  # a view into its storage at an odd place: int64 words need an aligned copy
        raw = raw.clone()
    row_bytes = 8 * _ROW_WORDS
    rows = raw.numel() // row_bytes
    body = raw[: rows * row_bytes].view(torch.int64).view(rows, _ROW_WORDS)
    sums = _weighted_rows(body, _weights(raw.device), matmul=raw.device.type == "cpu")
    return sums.cpu(), raw[rows * row_bytes :].cpu().numpy().tobytes()


def _weighted_rows(body: torch.Tensor, weights: torch.Tensor, *, matmul: bool) -> torch.Tensor:
    """Each row of ``body`` (int64) times ``weights``, summed modulo 2**64: one ``mv`` on the CPU, else in chunks."""
    if matmul:
        return torch.mv(body, weights)
    return torch.cat([(chunk * weights).sum(1) for chunk in torch.split(body, _CHUNK_ROWS)])


def _sized(h: Any, tag: bytes, raw: bytes) -> None:
    h.update(tag + struct.pack("<Q", len(raw)) + raw)


def feed(h: Any, value: Any, *, objects: str = "repr", checksums: bool = False, depth: int = 0) -> bool:
    """Feed an unambiguous encoding of ``value`` into the hash ``h`` (``hashlib`` style ``update``).

    None, bools, ints (any size), floats (their bits), str and bytes, tensors (dtype, shape and raw bytes, copied to
    the CPU; a ``DTensor`` by its layout and this rank's local shard, :mod:`lightning_repro.shards`), mappings in
    sorted key order, lists and tuples. Any other object: ``objects="repr"`` hashes its type
    and ``repr`` (the checkpoint entry holds no such values), ``objects="attributes"`` its type and, a few levels
    deep, its ``__dict__``, never its ``repr`` (which may hold a memory address). With ``checksums=True`` a tensor of
    :data:`CHECKSUM_BYTES` or more contributes its :func:`row_checksums` instead of its bytes (computed on its
    device: a few times cheaper than hashing the bytes, and nothing but the checksums is copied to the host); smaller
    tensors and every other value are encoded alike either way. Returns whether a tensor was fed by its checksums.

    Examples:
        >>> import hashlib
        >>> a, b = hashlib.sha256(), hashlib.sha256()
        >>> feed(a, {"x": 1, "y": [1.0, None]}); feed(b, {"y": [1.0, None], "x": 1})
        False
        False
        >>> a.hexdigest() == b.hexdigest()
        True
    """
    if value is None or isinstance(value, bool):
        h.update(b"N" if value is None else (b"T" if value else b"F"))
    elif isinstance(value, int):
        _sized(h, b"i", str(value).encode())
    elif isinstance(value, float):
        h.update(b"f" + struct.pack("<d", value))
    elif isinstance(value, str):
        _sized(h, b"s", value.encode())
    elif isinstance(value, bytes):
        _sized(h, b"y", value)
    elif isinstance(value, torch.Tensor):
        return _feed_tensor(h, value, checksums)
    elif isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        h.update(b"d" + struct.pack("<Q", len(items)))
        summed = False
        for key, item in items:
            summed |= feed(h, key, objects=objects, checksums=checksums, depth=depth + 1)
            summed |= feed(h, item, objects=objects, checksums=checksums, depth=depth + 1)
        return summed
    elif isinstance(value, (list, tuple)):
        h.update((b"l" if isinstance(value, list) else b"u") + struct.pack("<Q", len(value)))
        summed = False
        for item in value:
            summed |= feed(h, item, objects=objects, checksums=checksums, depth=depth + 1)
        return summed
    elif objects == "repr":
        _sized(h, b"o", f"{type(value).__qualname__}:{value!r}".encode())
    else:
        _sized(h, b"o", f"{type(value).__module__}.{type(value).__qualname__}".encode())
        attributes = getattr(value, "__dict__", None)
        if depth < 4 and isinstance(attributes, dict) and not callable(value):
            return feed(h, attributes, objects=objects, checksums=checksums, depth=depth + 1)
    return False


def _feed_tensor(h: Any, value: torch.Tensor, checksums: bool) -> bool:
    layout = shard_layout(value)
    if layout is not None:  # a DTensor: its layout, then this rank's local shard
        _sized(h, b"D", layout.encode())
        value = local_shard(value)
    described = f"{value.dtype}{tuple(value.shape)}".encode()
    if checksums and value.numel() * value.element_size() >= CHECKSUM_BYTES:
        sums, rest = row_checksums(value)
        _sized(h, b"c", described)  # another tag than a tensor fed by its bytes: the two never collide
        h.update(sums.numpy().tobytes())
        h.update(rest)
        return True
    t = value.detach().cpu().contiguous()
    _sized(h, b"t", described)
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return False
