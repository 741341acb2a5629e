"""What lightning-repro writes into a checkpoint, and how a resume reads and applies it.

Owns the entry schema and its seal (``entry``: ``Entry``, ``RankPart``, version 2, version 1 still read), the one
hash encoding of nested values and tensors (``hashing``) and that encoding kept as bytes for the seal (``encoding``),
building this rank's part from the trainer and gathering every rank's part (``save``; the gather's wire: ``gather``),
choosing and applying a parsed entry on resume with the topology policy (``state``), and
the restore check (``verify``: a digest per saved component, recomputed before the first resumed batch), and what a
mid-epoch resume's skipped epoch start set (``trainable``: the trainable flags; ``accumulation``: the accumulation
of a ``GradientAccumulationScheduler``; ``attributes``: what the module's and user callbacks' epoch-start hooks
set), the generators the module and the user's callbacks hold (``owned``), and each rank's own module buffers
where the file's state holds another rank's (``replica``).

May import the bottom layer (``exceptions``, ``seeding``, ``streams``, ``rng``, ``_types``, ``_warn``,
``_lightning``), ``manifest.fingerprint`` (the environment fingerprint a rank's part records), ``data.takeover`` and
``data.mapepoch`` (the train samplers' positions, a map-style dataset's ``set_epoch`` state); nothing above it.
"""

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
