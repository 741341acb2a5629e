"""A value's encoding as :func:`~lightning_repro.checkpoint.hashing.feed` feeds it to a hash, kept as bytes.

Hashing the encoding is hashing the value. The entry's seal (:func:`~lightning_repro.checkpoint.entry.entry_digest`)
splices in encodings computed before: each rank's part encoded by the rank that built it, in parallel with the others
(it travels with the part), and the values that rarely change between saves (the manifest, the environment)
remembered from the last save.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any

from lightning_repro.checkpoint.hashing import feed

__all__ = ["encode", "encode_list", "encode_static"]


class _Collect:
    """A stand-in for a hash that keeps what ``feed`` feeds it."""

    __slots__ = ("chunks",)

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def update(self, data: Any) -> None:
        self.chunks.append(bytes(data))


def encode(value: Any) -> bytes:
    """The bytes ``feed`` feeds a hash for ``value``, in one piece.

    Examples:
        >>> import hashlib, torch
        >>> a, b = hashlib.sha256(), hashlib.sha256()
        >>> _ = feed(a, {"x": [1, torch.ones(2)]}); b.update(encode({"x": [1, torch.ones(2)]}))
        >>> a.hexdigest() == b.hexdigest()
        True
    """
    collect = _Collect()
    feed(collect, value)
    return b"".join(collect.chunks)


def encode_list(codes: Sequence[bytes]) -> bytes:
    """The encoding of a list whose items are encoded as ``codes`` (an entry's ``ranks``)."""
    return b"l" + struct.pack("<Q", len(codes)) + b"".join(codes)  # feed's framing of a list


_STATIC: dict[str, tuple[bytes, bytes]] = {}
"""The last value :func:`encode_static` encoded under each key: its pickle and its encoding."""


def encode_static(key: str, value: Any) -> bytes:
    """:func:`encode` of a value that rarely changes between saves (the manifest, the environment), remembered.

    The last value of each ``key`` is known again by its pickle (a few us, where encoding takes a few hundred):
    equal pickles are equal values of plain types, and any difference (``1`` for ``True``, ``-0.0`` for ``0.0``, a
    key's order) encodes the value again.

    Examples:
        >>> encode_static("example", {"torch": "2.13.0"}) == encode({"torch": "2.13.0"})
        True
        >>> encode_static("example", {"torch": "2.14.0"}) == encode({"torch": "2.14.0"})
        True
    """
    try:
        pickled = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # not picklable: not remembered
        return encode(value)
    known = _STATIC.get(key)
    if known is not None and known[0] == pickled:
        return known[1]
    code = encode(value)
    _STATIC[key] = (pickled, code)
    return code
