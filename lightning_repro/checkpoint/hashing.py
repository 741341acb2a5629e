"""One exact, type-tagged encoding of nested plain values and tensors, fed into a hash (entry seal, restore check).

The row checksums of CPU tensors come from the optional C extension :mod:`lightning_repro.checkpoint._rowsums` (one
pass over memory, about the speed of a plain sum of the bytes; ``torch.mv`` of the int64 rows reads them at about
half that) when it was built and its values equal the torch path's for a set of rows checked at import
(:data:`NATIVE`); ``LIGHTNING_REPRO_NATIVE=0`` turns it off, as it turns off the seeding kernel. Without it the torch
path computes the same values. Tensors on other devices always take the torch path (on their device).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from typing import Any

import torch

from lightning_repro.shards import local_shard, shard_layout

__all__ = ["CHECKSUM_BYTES", "NATIVE", "checksum_status", "feed", "native_checksums", "row_checksums"]

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


def native_checksums(wanted: str | None = None) -> Any:
    """The compiled checksum kernel, checked against the torch path, or None (see the module).

    Args:
        wanted: The value of ``LIGHTNING_REPRO_NATIVE`` (None: unset, the kernel is wanted).

    Raises:
        ValueError: ``wanted`` is not one of ``1``, ``true``, ``yes``, ``on``, ``0``, ``false``, ``no``, ``off``.
    """
    value = (wanted or "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return None
    if value not in ("", "1", "true", "yes", "on"):
        raise ValueError(
            f"`LIGHTNING_REPRO_NATIVE` must be 1 or 0 (true/false, yes/no, on/off), got {wanted!r};"
            " set `LIGHTNING_REPRO_NATIVE=0` to turn the compiled kernels off, or unset it"
        )
    try:
        import lightning_repro.checkpoint._rowsums as _rowsums
    except ImportError:  # not built (no C compiler where it was installed): torch computes the checksums
        return None
    generator = torch.Generator().manual_seed(0x5EED)  # not the process streams
    words = torch.randint(-(2**63), 2**63 - 1, (7 * _ROW_WORDS + 1,), dtype=torch.int64, generator=generator)
    words[:_ROW_WORDS] = -1  # a row of all-ones words: every product wraps
    expected = _weighted_rows(words[1:].view(7, _ROW_WORDS), _weights(torch.device("cpu")), matmul=True)
    raw = words.view(torch.uint8)[1:-7]  # rows starting one byte into a word: the unaligned loads
    wanted_sums = _weighted_rows(raw.clone().view(torch.int64).view(-1, _ROW_WORDS), _weights(raw.device), matmul=True)
    for kernel in range(len(_rowsums.kernels())):
        got, unaligned = torch.empty(7, dtype=torch.int64), torch.empty(7, dtype=torch.int64)
        _rowsums.checksums(words[1:].numpy(), got.numpy(), kernel)
        _rowsums.checksums(raw.numpy(), unaligned.numpy(), kernel)
        if not (torch.equal(got, expected) and torch.equal(unaligned, wanted_sums)):
            return None
    return _rowsums


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
    flat = _flat(tensor)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    raw = flat.view(torch.uint8)
    row_bytes = 8 * _ROW_WORDS
    rows = raw.numel() // row_bytes
    if NATIVE is not None and raw.device.type == "cpu":  # one pass over the bytes where they are, any alignment
        sums = torch.empty(rows, dtype=torch.int64)
        NATIVE.checksums(raw[: rows * row_bytes].numpy(), sums.numpy())
        return sums, raw[rows * row_bytes :].numpy().tobytes()
    if raw.storage_offset() % 8:  # a view into its storage at an odd place: int64 words need an aligned copy
        raw = raw.clone()
    body = raw[: rows * row_bytes].view(torch.int64).view(rows, _ROW_WORDS)
    sums = _weighted_rows(body, _weights(raw.device), matmul=raw.device.type == "cpu")
    return sums.cpu(), raw[rows * row_bytes :].cpu().numpy().tobytes()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one contiguous dimension whose stride is 1, which ``view(dtype)`` needs."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.stride(0) != 1:  # 0 or 1 elements seen through a stride: contiguous() keeps the stride, view() refuses it
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat


def _weighted_rows(body: torch.Tensor, weights: torch.Tensor, *, matmul: bool) -> torch.Tensor:
    """Each row of ``body`` (int64) times ``weights``, summed modulo 2**64: one ``mv`` on the CPU, else in chunks."""
    if matmul:
        return torch.mv(body, weights)
    return torch.cat([(chunk * weights).sum(1) for chunk in torch.split(body, _CHUNK_ROWS)])


NATIVE = native_checksums(os.environ.get("LIGHTNING_REPRO_NATIVE"))
"""The checked compiled kernel (``checksums``, ``kernels``), or None: the checksums of CPU tensors come from torch."""


def checksum_status() -> str:
    """Whether the checksum kernel is in use here, and if not why (for ``lightning-repro doctor``)."""
    if NATIVE is not None:
        return f"in use ({NATIVE.kernels()[-1]}): the restore check's row checksums in one pass over memory"
    wanted = (os.environ.get("LIGHTNING_REPRO_NATIVE") or "").strip().lower()
    if wanted in ("0", "false", "no", "off"):
        return f"off (LIGHTNING_REPRO_NATIVE={os.environ['LIGHTNING_REPRO_NATIVE']}): torch, same values, slower"
    try:
        import lightning_repro.checkpoint._rowsums  # noqa: F401
    except ImportError:
        return "not built (no C compiler where lightning-repro was installed): torch, same values, slower"
    return "not used: it disagreed with torch at import: torch, same values"


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
    t = _flat(value).cpu()
    _sized(h, b"t", described)
    if t.numel():
        h.update(t.view(torch.uint8).numpy())
    return False
