"""The entry's gather and seal at save time: every value as it was, with less work (issue 21, the DDP save time).

What changed is how the parts travel and how the seal is computed, never what the checkpoint holds: these tests
compare with the slow paths (torch's pickling of a tensor, ``seal_entry`` of the whole dict) bit for bit, and show
that the slow work is not done (torch's per-storage ``torch.save`` in the gather, encoding the other ranks' parts or
an unchanged manifest again).
"""

from __future__ import annotations

import copy
import hashlib
import pickle
import struct
from typing import Any

import helpers
import pytest
import torch

from lightning_repro.checkpoint import encoding, gather, save
from lightning_repro.checkpoint.encoding import encode, encode_static
from lightning_repro.checkpoint.entry import DIGEST_KEY, Entry, RankPart, entry_digest, seal_entry
from lightning_repro.rng import capture_process_streams, digest_process_streams


def _sha(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()


def _part(batches: int, **extra: Any) -> dict[str, Any]:
    streams = capture_process_streams()
    part = RankPart(
        streams=streams,
        streams_sha256=digest_process_streams(streams),
        batches=batches,
        data=[{"index": 0, "epoch": 1, "pass": 0, "offset": batches, "length": 8, "order": "shuffled"}],
        metrics={"acc": {"states": {"tp": torch.tensor([batches, 2])}, "update_count": batches}},
        restore_sha256={"parameters": "c:" + "0" * 64},
        **extra,
    )
    return part.to_dict()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


# ---------------------------------------------------------------------------------------- the wire
def test_a_packed_part_comes_back_with_every_tensor_bit_for_bit() -> None:
    base = torch.arange(12, dtype=torch.float32)
    odd = {
        "scalar": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "complex": torch.tensor([1 + 2j], dtype=torch.complex64),
        "negzero": torch.tensor([-0.0, float("nan")], dtype=torch.float64),
        "view": base[2:5],  # a view into a larger storage: pickled as torch pickles it
        "strided": base.reshape(3, 4).t(),
        "grad": torch.ones(2, requires_grad=True),
        "shared": [base, base],
    }
    part = _part(5, grads={"w": torch.randn(4, 4)}, iterables={"0": odd})
    back, code = gather.unpack_part(gather.pack_part(part, b"code"))
    assert code == b"code"
    sent, got = _tensors(part), _tensors(back)
    assert len(sent) == len(got) > 15
    assert [_sha(t) for t in got] == [_sha(t) for t in sent]
    assert [t.requires_grad for t in got] == [t.requires_grad for t in sent]
    assert [t.stride() for t in got] == [t.stride() for t in sent]
    assert back["iterables"]["0"]["shared"][0] is back["iterables"]["0"]["shared"][1]  # one tensor, as sent
    assert encode(back) == encode(part)  # the same value to the seal
    assert back["streams_sha256"] == digest_process_streams(back["streams"])


def test_a_part_travels_without_torch_pickling_its_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch pickles a tensor through a ``torch.save`` into memory per storage (and a ``torch.load`` back): about a
    millisecond a part, the largest cost of the gather. A plain CPU tensor travels as its raw bytes instead."""
    part = _part(3)
    sent = _tensors(part)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a part's tensor went through torch.save")

    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(torch.serialization, "save", refuse)
    back, _ = gather.unpack_part(gather.pack_part(part, encode(part)))
    assert [_sha(t) for t in _tensors(back)] == [_sha(t) for t in sent]


# ---------------------------------------------------------------------------------------- the seal
def _fake_world(monkeypatch: pytest.MonkeyPatch, theirs: dict[str, Any], rank: int = 0) -> list[int]:
    """A two-rank world in this process: the other rank sends ``theirs`` as it packs it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    payload = gather.pack_part(theirs, encode(theirs))
    rounds: list[int] = []

    def all_gather(out: list[torch.Tensor], sent: torch.Tensor) -> None:
        capacity = sent.numel() - 8
        assert len(payload) <= capacity
        other = struct.pack("<q", len(payload)) + payload + bytes(capacity - len(payload))
        rounds.append(sent.numel())
        out[rank].copy_(sent)
        out[1 - rank].copy_(torch.frombuffer(bytearray(other), dtype=torch.uint8))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(distributed_c10d, "_get_object_coll_device", lambda: "cpu")
    return rounds


def _entry(part: dict[str, Any], manifest: dict[str, Any]) -> Entry:
    return Entry(
        seed=3,
        topology={"world_size": 2, "num_nodes": 1, "num_workers": [2]},
        ranks=[RankPart(**part)],
        environment={"torch": torch.__version__, "num_threads": "1"},
        callback_metrics={"callback_metrics": {"loss": torch.tensor(0.5)}},
        manifest=manifest,
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_the_seal_from_the_ranks_encodings_is_the_seal_of_the_whole_entry(
    monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    theirs = _part(9, grads={"w": torch.randn(3)})
    rounds = _fake_world(monkeypatch, theirs, rank)
    trainer: Any = helpers.gather_trainer(2)
    manifest = {"code": {"git": "abc", "dirty": False}, "seeds": [1, 2.5, None, -0.0]}
    mine = _entry(_part(4), manifest)
    sealed = save.gather_and_seal(mine, trainer)
    assert len(rounds) == 1
    assert [part["batches"] for part in sealed["ranks"]] == ([4, 9] if rank == 0 else [9, 4])
    assert sealed[DIGEST_KEY] == entry_digest(sealed)  # what a resume recomputes from the file
    assert (
        sealed[DIGEST_KEY]
        == seal_entry(copy.deepcopy({k: v for k, v in sealed.items() if k != DIGEST_KEY}))[DIGEST_KEY]
    )
    Entry.from_dict(sealed)  # the checks of a loaded entry pass
    # the other rank's part counts in the seal: another part, another seal
    _fake_world(monkeypatch, {**theirs, "batches": 10}, rank)
    assert save.gather_and_seal(mine, trainer)[DIGEST_KEY] != sealed[DIGEST_KEY]


def test_the_seal_encodes_no_other_rank_and_no_unchanged_value_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank encodes its own part (in parallel with the others); the manifest, unchanged, is not encoded again."""
    theirs = _part(9)
    _fake_world(monkeypatch, theirs)
    trainer: Any = helpers.gather_trainer(2)
    manifest = {"code": {"git": "abc"}, "files": [f"data/{i}.bin" for i in range(50)]}
    mine = _entry(_part(4), manifest)
    first = save.gather_and_seal(mine, trainer)
    encoded: list[Any] = []
    real = encoding.feed

    def counting(h: Any, value: Any, **kwargs: Any) -> bool:
        if kwargs.get("depth", 0) == 0:
            encoded.append(value)
        return real(h, value, **kwargs)

    monkeypatch.setattr(encoding, "feed", counting)
    monkeypatch.setattr("lightning_repro.checkpoint.seal.feed", counting)
    again = save.gather_and_seal(mine, trainer)
    assert again[DIGEST_KEY] == first[DIGEST_KEY] == entry_digest(again)
    parts = [value for value in encoded if isinstance(value, dict) and "streams" in value]
    assert [part["batches"] for part in parts] == [4]  # this rank's part only
    assert not any(value is again["manifest"] or value == manifest for value in encoded)
    assert not any(value == again["environment"] for value in encoded)


@pytest.mark.parametrize(
    "values",
    [
        [{"a": 1}, {"a": True}, {"a": 1.0}, {"a": 1}],
        [{"x": 0.0}, {"x": -0.0}, {"x": 0.0}],
        [{"k": [1, 2]}, {"k": (1, 2)}, {"k": [1, 2, 3]}],
        [{"torch": "2.13.0"}, {"torch": "2.13.0", "cuda": "None"}, {"torch": "2.13.0"}],
    ],
    ids=["bool-int-float", "signed-zero", "list-tuple", "keys"],
)
def test_a_remembered_encoding_is_only_reused_for_the_same_value(values: list[Any]) -> None:
    """Values equal under ``==`` but encoded differently (``1``/``True``/``1.0``, ``0.0``/``-0.0``) re-encode."""
    for value in values:
        assert encode_static("test-remembered", value) == encode(value)
    assert pickle.loads(pickle.dumps(values)) == values


def test_the_seal_of_a_single_process_entry_is_the_seal_of_its_dict() -> None:
    trainer: Any = helpers.gather_trainer(1)
    entry = _entry(_part(2), {"code": {}})
    sealed = save.gather_and_seal(entry, trainer)
    assert sealed[DIGEST_KEY] == entry_digest(entry.to_dict())


# ---------------------------------------------------------------------------------------- through the public paths
def _echo_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks in this process, the other one sending what this one sends (whatever the wire's format)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def all_gather(out: list[torch.Tensor], sent: torch.Tensor) -> None:
        for t in out:
            t.copy_(sent)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(distributed_c10d, "_get_object_coll_device", lambda: "cpu")


def test_the_gather_runs_no_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before issue 21 a part was pickled with its tensors, a ``torch.save`` per tensor (and a load per part)."""
    entry = _entry(_part(4), {"code": {}})
    sent = _tensors(entry.ranks[0].to_dict())
    _echo_world(monkeypatch)
    saves: list[Any] = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: saves.append(a) or real(*a, **k))
    trainer: Any = helpers.gather_trainer(2)
    gathered = save.gather_ranks(entry, trainer)
    assert not saves
    assert len(gathered.ranks) == 2
    for part in gathered.ranks:
        assert [_sha(t) for t in _tensors(part.to_dict())] == [_sha(t) for t in sent]


def test_a_second_save_does_not_encode_the_manifest_or_the_environment_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seal of the manifest and the environment (unchanged between saves) is remembered, not recomputed."""
    import sys

    import helpers
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_repro import DeterminismCallback
    from lightning_repro.checkpoint import hashing

    callback = DeterminismCallback(seed=3)
    trainer = helpers.fast_trainer([callback], max_steps=2)
    trainer.fit(BoringModel())
    first = callback.state_dict()
    fed: list[Any] = []
    real = hashing.feed

    def counting(h: Any, value: Any, **kwargs: Any) -> bool:
        fed.append(value)
        return real(h, value, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("lightning_repro.checkpoint") and getattr(module, "feed", None) is real:
            monkeypatch.setattr(module, "feed", counting)
    second = callback.state_dict()
    monkeypatch.undo()
    assert second[DIGEST_KEY] == first[DIGEST_KEY] == entry_digest(second)
    assert second["manifest"] == first["manifest"]
    assert second["manifest"]
    assert any(value is second["ranks"][0]["data"] for value in fed)  # its own part: encoded
    assert not any(value is second["manifest"] or value is second["environment"] for value in fed)
