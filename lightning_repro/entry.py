"""The checkpoint entry's schema at its documented path; the module is :mod:`lightning_repro.checkpoint.entry`."""

from __future__ import annotations

from lightning_repro.checkpoint.entry import (
    DIGEST_KEY,
    ENTRY_VERSION,
    Entry,
    RankPart,
    entry_digest,
    read_checkpoint,
    seal_entry,
)

__all__ = ["DIGEST_KEY", "ENTRY_VERSION", "Entry", "RankPart", "entry_digest", "read_checkpoint", "seal_entry"]
