"""The data side of a run: what lightning-repro does to a train loader so its order and its draws are keyed.

Owns the takeover of a loader (``takeover``: the shallow copy, the seeded generator, the chained
``worker_init_fn``), the resumable samplers (``samplers``: ``ReproBatchSampler``; ``order``: the computed orders
and their O(1) slicing), samplers we do not know (``foreign``), sample- and batch-keyed access (``keyed``), the
generators a dataset holds (``generators``), which process streams a sample draws from (``usage``), the fast paths that
seed python's and numpy's streams (``fastrng`` and the optional C kernel ``_seedkernel``), what the streaming
libraries need of the takeover (``libraries``: HF ``datasets``, litdata, webdataset, recognised without importing
them; ``litdatamix``: litdata's mix of datasets resumed with workers), the streaming iterables, their collate and
positions (``streaming``, ``streamcollate``, ``stamps``, ``workerpos``;
``epochstart``: the first pass after an epoch-end checkpoint), a map-style dataset given its epoch by the user's
``set_epoch`` (``mapepoch``: recorded and given back on a mid-epoch resume), webdataset's ``WebLoader`` taken over
through the ``DataLoader`` it holds (``webloader``), and what the resume line
says of each train loader's position (``resumeline``: exact or not, and why).

May import the bottom layer only: ``exceptions``, ``seeding``, ``streams``, ``rng``, ``_types``, ``_warn`` and
``_lightning``.
"""

from __future__ import annotations

from lightning_repro.data.keyed import KeyedBatch, SampleKey
from lightning_repro.data.samplers import ReproBatchSampler
from lightning_repro.data.takeover import StreamKey, prepare_dataloader

__all__ = ["KeyedBatch", "ReproBatchSampler", "SampleKey", "StreamKey", "prepare_dataloader"]
