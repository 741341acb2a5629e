"""One exact, type-tagged encoding of nested plain values and tensors, fed into a hash (entry seal, restore check)."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import torch

from lightning_repro.shards import local_shard, shard_layout

__all__ = ["feed"]


def _sized(h: Any, tag: bytes, raw: bytes) -> None:
    h.update(tag + struct.pack("<Q", len(raw)) + raw)


def feed(h: Any, value: Any, *, objects: str = "repr", depth: int = 0) -> None:
    """Feed an unambiguous encoding of ``value`` into the hash ``h`` (``hashlib`` style ``update``).

    None, bools, ints (any size), floats (their bits), str and bytes, tensors (dtype, shape and raw bytes, copied to
    the CPU; a ``DTensor`` by its layout and this rank's local shard, :mod:`lightning_repro.shards`), mappings in
    sorted key order, lists and tuples. Any other object: ``objects="repr"`` hashes its type
    and ``repr`` (the checkpoint entry holds no such values), ``objects="attributes"`` its type and, a few levels
    deep, its ``__dict__``, never its ``repr`` (which may hold a memory address).

    Examples:
        >>> import hashlib
        >>> a, b = hashlib.sha256(), hashlib.sha256()
        >>> feed(a, {"x": 1, "y": [1.0, None]}); feed(b, {"y": [1.0, None], "x": 1})
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
        layout = shard_layout(value)
        if layout is not None:  # a DTensor: its layout, then this rank's local shard
            _sized(h, b"D", layout.encode())
            value = local_shard(value)
        t = value.detach().cpu().contiguous()
        _sized(h, b"t", f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        h.update(b"d" + struct.pack("<Q", len(items)))
        for key, item in items:
            feed(h, key, objects=objects, depth=depth + 1)
            feed(h, item, objects=objects, depth=depth + 1)
    elif isinstance(value, (list, tuple)):
        h.update((b"l" if isinstance(value, list) else b"u") + struct.pack("<Q", len(value)))
        for item in value:
            feed(h, item, objects=objects, depth=depth + 1)
    elif objects == "repr":
        _sized(h, b"o", f"{type(value).__qualname__}:{value!r}".encode())
    else:
        _sized(h, b"o", f"{type(value).__module__}.{type(value).__qualname__}".encode())
        attributes = getattr(value, "__dict__", None)
        if depth < 4 and isinstance(attributes, dict) and not callable(value):
            feed(h, attributes, objects=objects, depth=depth + 1)
