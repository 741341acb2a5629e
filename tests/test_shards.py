"""Sharded tensors (``DTensor``) in our digests, and the topology rule of sharded runs, in this process.

A one-rank gloo group and a one-device CPU mesh give real ``DTensor``s without starting processes: the restore
check, the entry's seal, the step trace and ``digest_tensors`` take each rank's local shard and its layout. The
2-rank jobs are in ``tests/test_sharded.py`` and ``tests/test_sharded_topology.py`` (the marked run of scripts/test.sh).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_repro import NotExactWarning, TopologyError, digest_tensors
from lightning_repro.checkpoint.entry import Entry, RankPart, seal_entry
from lightning_repro.checkpoint.hashing import feed
from lightning_repro.checkpoint.state import parse_entry
from lightning_repro.checkpoint.verify import digest_value
from lightning_repro.rng import capture_process_streams, digest_process_streams
from lightning_repro.trace.digest import Digest


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    store = tmp_path_factory.mktemp("store") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def _sharded(mesh: Any, value: torch.Tensor, placement: str = "shard") -> Any:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return distribute_tensor(value, mesh, [Shard(0) if placement == "shard" else Replicate()])


def _sha(value: Any) -> str:
    h = hashlib.sha256()
    feed(h, value)
    return h.hexdigest()


def test_every_digest_takes_the_local_shard_and_its_layout(mesh: Any) -> None:
    """Before sharded support, each of these raised ``.numpy() is not supported for tensor subclasses``."""
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    shard, replica = _sharded(mesh, full), _sharded(mesh, full, "replicate")
    assert torch.equal(shard.to_local(), full)  # one rank: the local shard is the whole tensor
    for digest in (_sha, digest_value, lambda v: digest_tensors({"w": v})):
        assert digest(shard) == digest(_sharded(mesh, full.clone()))  # exact, the same for equal shards
        assert digest(shard) != digest(replica)  # same bytes, another sharding: another digest
        assert digest(shard) != digest(full)  # and never the plain tensor's
        assert digest(shard) != digest(_sharded(mesh, full + 1))
    traced = []
    for value in (shard, replica, shard):
        record = Digest()
        record.add({"w": value})
        traced.append(record.hexdigest([]))
    assert traced[0] == traced[2] != traced[1]


def test_a_plain_tensor_is_digested_as_before() -> None:
    """No layout for a plain tensor: the digests of unsharded runs (and of older checkpoints) do not change."""
    from lightning_repro.shards import shard_layout

    t = torch.ones(3)
    assert shard_layout(t) is None
    h = hashlib.sha256()
    h.update(b"t" + (len(b"torch.float32(3,)")).to_bytes(8, "little") + b"torch.float32(3,)")
    h.update(t.view(torch.uint8).numpy())
    assert _sha(t) == h.hexdigest()


def test_layout_names_placements_mesh_and_shape(mesh: Any) -> None:
    from lightning_repro.shards import shard_layout

    layout = shard_layout(_sharded(mesh, torch.zeros(4, 3)))
    assert layout is not None
    assert "Shard(dim=0)" in layout
    assert "('data_parallel',)" in layout
    assert "shape=(4, 3)" in layout


def test_an_accumulated_gradient_comes_back_as_its_parameter_is_sharded(mesh: Any) -> None:
    from lightning_repro.shards import local_shard, shaped_like, shard_layout

    param = torch.nn.Parameter(_sharded(mesh, torch.zeros(4, 3)))
    grad = shaped_like(torch.ones(4, 3), param)
    assert shard_layout(grad) == shard_layout(param)
    assert torch.equal(local_shard(grad), torch.ones(4, 3))
    plain = torch.zeros(2)
    assert torch.equal(shaped_like(torch.ones(2), plain), torch.ones(2))


def _entry(world: int, replicas: int | None = None) -> dict[str, Any]:
    streams = capture_process_streams()
    part = RankPart(streams=streams, streams_sha256=digest_process_streams(streams), batches=0, data=[])
    topology: dict[str, Any] = {"world_size": world, "num_nodes": 1, "num_workers": [0]}
    if replicas is not None:
        topology["data_parallel_size"] = replicas
    return seal_entry(Entry(seed=3, topology=topology, ranks=[part] * world).to_dict())


@pytest.mark.parametrize(
    ("saved", "now"),
    [((2, None), (0, 1)), ((2, 1), (0, 2)), ((2, 1), (0, 1))],
    ids=["dp2-to-dp1xtp2", "dp1xtp2-to-dp2", "same"],
)
def test_another_data_parallel_split_of_the_same_world_is_a_topology_change(
    saved: tuple[int, int | None], now: tuple[int, int]
) -> None:
    entry = _entry(*saved)
    same = (saved[1] or saved[0]) == now[1]
    if same:
        state = parse_entry(entry, seed=3, rank=0, world_size=2, data_parallel=now)
        assert state is not None
        assert not state.remap
        return
    with pytest.raises(TopologyError, match=r"world size 2 \(1 node\(s\)(, data parallel \d x tensor parallel \d)?\)"):
        parse_entry(entry, seed=3, rank=0, world_size=2, data_parallel=now)
    with pytest.warns(NotExactWarning, match="on_topology_change='reseed'"):
        state = parse_entry(entry, seed=3, rank=1, world_size=2, data_parallel=now, on_topology_change="reseed")
    assert state is not None
    assert state.remap
    # the ranks of one tensor-parallel group (data-parallel rank 0 both) get one re-seeded stream
    with pytest.warns(NotExactWarning, match="on_topology_change='reseed'"):
        other = parse_entry(entry, seed=3, rank=0, world_size=2, data_parallel=now, on_topology_change="reseed")
    assert other is not None
    assert digest_process_streams(other.streams) == digest_process_streams(state.streams)
