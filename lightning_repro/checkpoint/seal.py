"""The entry's own SHA-256: written last into it (:func:`seal_entry`), checked first when it is read."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

from lightning_repro.checkpoint.hashing import feed
from lightning_repro.exceptions import CorruptStateError

__all__ = ["DIGEST_KEY", "check_digest", "entry_digest", "seal_entry"]

DIGEST_KEY = "entry_sha256"
"""The key of the entry's own SHA-256 (see :func:`seal_entry`)."""


def entry_digest(entry: dict[str, Any], *, encoded: Mapping[str, bytes] | None = None) -> str:
    """SHA-256 of a whole checkpoint entry: every key but ``entry_sha256``, every tensor's dtype, shape and bytes.

    ``encoded``: the encoding of some of its values by key (:func:`~lightning_repro.checkpoint.encoding.encode`),
    computed before: the digest is the same.

    Examples:
        >>> import torch
        >>> from lightning_repro.checkpoint.encoding import encode
        >>> entry = {"version": 2, "seed": 3, "metrics": {"tp": torch.tensor([2])}}
        >>> entry_digest(entry) == entry_digest({**entry, "metrics": {"tp": torch.tensor([2])}})
        True
        >>> entry_digest(entry) == entry_digest({**entry, "metrics": {"tp": torch.tensor([3])}})
        False
        >>> entry_digest(entry) == entry_digest(entry, encoded={"seed": encode(3)})
        True
    """
    h = hashlib.sha256(b"lightning-repro entry v1")  # the encoding's name, the same for every entry version
    value = {key: item for key, item in entry.items() if key != DIGEST_KEY}
    if not encoded:
        feed(h, value)
        return h.hexdigest()
    # feed's framing of a mapping (its items in the order feed sorts them), the encoded values spliced in
    items = sorted(value.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
    h.update(b"d" + struct.pack("<Q", len(items)))
    for key, item in items:
        feed(h, key)
        code = encoded.get(key)
        if code is None:
            feed(h, item)
        else:
            h.update(code)
    return h.hexdigest()


def seal_entry(entry: dict[str, Any], *, encoded: Mapping[str, bytes] | None = None) -> dict[str, Any]:
    """Write the SHA-256 of the whole entry into it (``entry_sha256``) and return it; call it last.

    ``encoded``: as for :func:`entry_digest`.
    """
    entry[DIGEST_KEY] = entry_digest(entry, encoded=encoded)
    return entry


def check_digest(entry: dict[str, Any]) -> None:
    """Raise :class:`CorruptStateError` when ``entry`` does not match its ``entry_sha256``, or (version 2) has none."""
    saved = entry.get(DIGEST_KEY)
    if saved is None and entry.get("version") == 1:
        return  # written before entries were sealed: the per-part checks still run
    if saved is None:  # every version-2 entry was written sealed: its seal was taken off
        raise CorruptStateError(
            "the lightning-repro checkpoint entry is damaged: it has no seal (entry_sha256), which every entry of its"
            " version is written with, so its content cannot be checked"
        )
    if not isinstance(saved, str) or saved != entry_digest(entry):
        raise CorruptStateError(
            "the lightning-repro checkpoint entry is damaged: its content (RNG streams, data position, metric states,"
            " logged values, topology, gradients or another part) does not match its saved SHA-256"
        )
