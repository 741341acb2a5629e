"""``checkpoint/replica.py``: after the entry's gather, the ranks whose module buffers differ from rank 0's send them.

The DDP jobs of ``tests/test_ddp_buffers.py`` resume with them; here the exchange itself, over a stand-in for
``torch.distributed`` (rank 0 of 2), and the giving back.
"""

from __future__ import annotations

import struct
from typing import Any

import helpers
import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from lightning_repro.checkpoint import replica
from lightning_repro.checkpoint.encoding import encode
from lightning_repro.checkpoint.gather import pack_part


def _trainer(module: torch.nn.Module, *, ddp: bool = True) -> Any:
    return helpers.gather_trainer(2, module, ddp=ddp)


def _net() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    net[1].register_buffer("scratch", torch.ones(2), persistent=False)  # not in state_dict(): never sent
    return net


@pytest.fixture
def rank0_of_2(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """``torch.distributed`` as rank 0 of 2 sees it; rank 1's payload is what the test appends to the list."""
    theirs: list[bytes] = []

    def all_gather(out: list[torch.Tensor], sent: torch.Tensor) -> None:
        payload = theirs[0]
        capacity = sent.numel() - 8
        other = struct.pack("<q", len(payload)) + payload + bytes(capacity - len(payload))
        out[0].copy_(sent)
        out[1].copy_(torch.frombuffer(bytearray(other), dtype=torch.uint8))

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(distributed_c10d, "_get_object_coll_device", lambda: "cpu")
    return theirs


def test_a_rank_unlike_rank_0_sends_its_buffers_in_a_second_round(rank0_of_2: list[bytes]) -> None:
    mine, other = _net(), _net()
    other[1].running_mean.add_(0.5)  # rank 1's statistics moved with its own batches
    own = replica._persistent_buffers(other)
    assert sorted(own) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    rank0_of_2.append(pack_part({"buffers": {k: v.clone() for k, v in own.items()}}, b""))
    parts = [
        {
            "batches": 1,
            "replica": {"buffers_sha256": replica._digest(replica._persistent_buffers(mine)), "forward_sync": True},
        },
        {"batches": 2, "replica": {"buffers_sha256": replica._digest(own), "forward_sync": True}},
    ]
    codes = [encode(p) for p in parts]
    replica.exchange_buffers(parts, codes, _trainer(mine))
    assert "buffers" not in parts[0]["replica"]  # the file holds rank 0's state
    got = parts[1]["replica"]["buffers"]
    assert sorted(got) == sorted(own)
    assert all(torch.equal(got[k], own[k]) for k in own)
    assert codes[1] == encode(parts[1])  # encoded again, for the seal
    assert replica.check_replica(parts[1]["replica"])


def test_under_a_sharded_strategy_every_rank_sends_its_buffers_when_two_differ(rank0_of_2: list[bytes]) -> None:
    """A distributed checkpoint keeps one copy of a replicated buffer, of a rank it chooses: each rank keeps its own."""
    mine, other = _net(), _net()
    other[1].running_var.add_(1.0)
    own = replica._persistent_buffers(other)
    rank0_of_2.append(pack_part({"buffers": {k: v.clone() for k, v in own.items()}}, b""))
    digests = [replica._digest(replica._persistent_buffers(mine)), replica._digest(own)]
    parts: list[dict[str, Any]] = [{"replica": {"buffers_sha256": d}} for d in digests]
    codes = [b"", b""]
    replica.exchange_buffers(parts, codes, _trainer(mine, ddp=False))
    assert torch.equal(parts[0]["replica"]["buffers"]["1.running_var"], mine[1].running_var)  # rank 0's own too
    assert torch.equal(parts[1]["replica"]["buffers"]["1.running_var"], other[1].running_var)
    assert codes == [encode(parts[0]), encode(parts[1])]


def test_no_round_when_every_rank_holds_rank_0s_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any) -> None:
        raise AssertionError("a collective without a rank to send")

    monkeypatch.setattr(dist, "all_gather", never)
    net = _net()
    record = {"buffers_sha256": replica._digest(replica._persistent_buffers(net)), "forward_sync": False}
    parts = [{"replica": dict(record)}, {"replica": dict(record)}]
    replica.exchange_buffers(parts, [b"", b""], _trainer(net))
    assert parts == [{"replica": record}, {"replica": record}]


def test_give_back_puts_the_ranks_own_buffers_back_unless_the_topology_changed() -> None:
    net, saved = _net(), _net()
    saved[1].running_var.mul_(3.0)
    record = {"buffers_sha256": "x", "forward_sync": True, "buffers": replica._persistent_buffers(saved)}
    replica.give_back(record, _trainer(net), remap=True, cache=None)  # another world size: rank 0's stay
    assert torch.equal(net[1].running_var, torch.ones(4))
    replica.give_back(record, _trainer(net), remap=False, cache=None)
    assert torch.equal(net[1].running_var, saved[1].running_var)
    assert replica.restored_own_buffers(record, remap=False)
    assert not replica.restored_own_buffers({**record, "buffers": {}}, remap=False)


def test_the_modules_a_callback_holds_count_but_not_the_lightning_module_again() -> None:
    """``EMAWeightAveraging`` keeps an averaged copy of each rank's module: its buffers are the rank's own too."""
    from lightning.pytorch.callbacks import Callback

    net = _net()

    class Holder(Callback):
        def __init__(self) -> None:
            self._copy = _net()  # private, as Lightning's own callbacks keep theirs
            self.model = net  # a reference to the LightningModule: its buffers are there once
            self.loss = torch.nn.MSELoss()  # no buffers

    trainer = helpers.gather_trainer(2, net)
    trainer.callbacks = [Holder()]
    found = replica._rank_buffers(trainer)
    held = f"callback[{trainer.callbacks[0].state_key}]._copy.1"
    names = ["num_batches_tracked", "running_mean", "running_var"]
    assert sorted(found) == [f"1.{n}" for n in names] + [f"{held}.{n}" for n in names]
    assert found[f"{held}.running_mean"] is trainer.callbacks[0]._copy[1].running_mean


def test_a_saved_buffer_this_run_lacks_is_named_in_a_warning() -> None:
    """A callback gone since the save, or a buffer of another shape: the rank goes on with the file's copy, said."""
    from lightning_repro._warn import WarningCache
    from lightning_repro.exceptions import NotExactWarning

    net = _net()
    buffers = {"callback[Gone]._copy.1.running_mean": torch.zeros(4), "1.running_var": torch.zeros(5)}
    trainer = _trainer(net)
    trainer.global_rank = 1
    with pytest.warns(NotExactWarning) as caught:
        replica.give_back({"buffers_sha256": "x", "buffers": buffers}, trainer, remap=False, cache=WarningCache())
    [message] = [str(w.message) for w in caught]
    assert "[rank 1] this rank's own 1.running_var, callback[Gone]._copy.1.running_mean at the save" in message
    assert torch.equal(net[1].running_var, torch.ones(4))  # not overwritten by a tensor of another shape


def _stopper(best: float) -> Any:
    from lightning.pytorch.callbacks import EarlyStopping

    stopper = EarlyStopping(monitor="val_rank", patience=1)
    stopper.best_score = torch.tensor(best)
    return stopper


def test_a_rank_sends_the_callback_states_unlike_rank_0s_and_gets_them_back(rank0_of_2: list[bytes]) -> None:
    """``EarlyStopping`` on a metric logged without ``sync_dist``: each rank's best score is its own."""
    mine, theirs = _trainer(_net(), ddp=False), _trainer(_net(), ddp=False)  # equal buffers: callbacks alone
    mine.callbacks, theirs.callbacks = [_stopper(12.0)], [_stopper(4.0)]
    records = [replica.replica_record(mine), replica.replica_record(theirs)]
    [key] = records[1]["callbacks_sha256"]
    assert key.startswith("EarlyStopping")
    assert records[0]["callbacks_sha256"][key] != records[1]["callbacks_sha256"][key]
    rank0_of_2.append(pack_part({"callbacks": {key: theirs.callbacks[0].state_dict()}}, b""))
    parts: list[dict[str, Any]] = [{"replica": records[0]}, {"replica": records[1]}]
    codes = [encode(p) for p in parts]
    replica.exchange_buffers(parts, codes, mine)
    assert "callbacks" not in parts[0]["replica"]  # the file holds rank 0's
    assert float(parts[1]["replica"]["callbacks"][key]["best_score"]) == 4.0
    assert codes[1] == encode(parts[1])
    assert replica.check_replica(parts[1]["replica"])
    resumed = _trainer(_net())
    resumed.callbacks = [_stopper(12.0)]  # what Lightning loads: rank 0's
    replica.give_back(parts[1]["replica"], resumed, remap=False, cache=None)
    assert float(resumed.callbacks[0].best_score) == 4.0


def test_a_callback_state_of_other_objects_is_left_out() -> None:
    from lightning.pytorch.callbacks import Callback

    class Odd(Callback):
        def state_dict(self) -> dict[str, Any]:
            return {"when": object()}  # neither loadable with weights_only=True nor hashed alike everywhere

    trainer = _trainer(_net(), ddp=False)
    trainer.callbacks = [Odd(), _stopper(1.0)]
    record = replica.replica_record(trainer)
    assert [k.split("{")[0] for k in record["callbacks_sha256"]] == ["EarlyStopping"]
    assert not replica.check_replica({**record, "callbacks": {"x": [1]}})


def test_a_state_dict_the_user_wrote_is_not_called_again_at_a_save() -> None:
    """Lightning calls each callback's ``state_dict()`` once per save (its own tests count the calls: a
    ``ModelCheckpoint`` subclass under DDP failed its count with the callback); ours calls only Lightning's own, which
    are pure, again."""
    from lightning.pytorch.callbacks import Callback

    class Counting(Callback):
        calls = 0

        def state_dict(self) -> dict[str, Any]:
            Counting.calls += 1
            return {"seen": 3}

    trainer = _trainer(_net(), ddp=False)
    trainer.callbacks = [Counting(), _stopper(1.0)]
    record = replica.replica_record(trainer)
    assert Counting.calls == 0
    assert [k.split("{")[0] for k in record["callbacks_sha256"]] == ["EarlyStopping"]
