"""The checkpoint entry in process: schema round trip, version 1, every damaged part, topology, environment, counters.

No Trainer runs here except in the version 1 resume test: a mistake in the schema or its checks fails in seconds.
The stored version 1 fixture is read for its layout only: its weights are another machine's float results.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helpers
import pytest
import torch

from lightning_repro import (
    CorruptStateError,
    NotExactWarning,
    ReproError,
    ReproWarning,
    SeedMismatchError,
    TopologyError,
    digest_tensors,
)
from lightning_repro._lightning.loops import fix_loop_progress
from lightning_repro.checkpoint.entry import ENTRY_VERSION, Entry, entry_digest, seal_entry
from lightning_repro.checkpoint.state import parse_entry
from lightning_repro.manifest.drift import environment_drift
from lightning_repro.rng import digest_process_streams

V1_CHECKPOINT = Path(__file__).parent / "data" / "entry_v1.ckpt"
"""Written by lightning-repro at commit 4d6d36c (entry version 1): ``test_callback._fit_counting(save=...)``.

Its schema, seed, RNG states and counters are read; its weights never: they are float results of the machine that
wrote it (another CPU computes other last bits). A resume from version 1 is built here (``helpers.as_v1_checkpoint``).
"""


def _v1() -> dict[str, Any]:
    entry: dict[str, Any] = torch.load(V1_CHECKPOINT, weights_only=True)["callbacks"]["DeterminismCallback"]
    return entry


def _v2() -> dict[str, Any]:
    return seal_entry(Entry.from_dict(_v1()).to_dict())


def test_v1_fixture_is_what_the_old_code_wrote() -> None:
    entry = _v1()
    assert entry["version"] == 1
    assert entry["other_ranks"] == []
    assert "ranks" not in entry
    assert entry["data"][0]["offset"] == 3


def test_v1_reads_as_v2_with_rank_parts_in_a_list() -> None:
    v1 = _v1()
    entry = Entry.from_dict(v1)
    assert entry.version == 1
    assert len(entry.ranks) == 1
    part = entry.ranks[0]
    assert part.batches == v1["batches"] == 3
    assert part.data == v1["data"]
    assert part.streams_sha256 == v1["streams_sha256"] == digest_process_streams(part.streams)
    assert digest_tensors(part.metrics["positives"]["states"]) == digest_tensors(v1["metrics"]["positives"]["states"])
    written = entry.to_dict()
    assert written["version"] == ENTRY_VERSION == 2
    assert "other_ranks" not in written
    assert sorted(written["ranks"][0]) == sorted(
        ["streams", "streams_sha256", "batches", "data", "metrics", "logged", "grads", "iterables"]
    )
    shared = set(written) - {"ranks"}
    assert shared == {
        "version", "seed", "topology", "environment", "pending", "remainder", "callback_metrics", "truncated", "loops",
        "manifest", "save_guards", "frozen",
    }  # fmt: skip


def test_round_trip_keeps_every_value() -> None:
    v2 = _v2()
    again = seal_entry(Entry.from_dict(v2).to_dict())
    assert again["entry_sha256"] == v2["entry_sha256"]  # a SHA-256 of every key, tensor dtype, shape and byte
    changed = copy.deepcopy(v2)
    changed["ranks"][0]["batches"] += 1
    assert entry_digest(changed) != v2["entry_sha256"]  # the comparison above can fail
    named = copy.deepcopy(v2)
    named["ranks"][0]["validation_metrics"] = ["val_acc"]  # optional: kept when given, left out when empty
    named = seal_entry(named)
    assert Entry.from_dict(named).to_dict()["ranks"][0]["validation_metrics"] == ["val_acc"]
    assert "validation_metrics" not in Entry.from_dict(v2).to_dict()["ranks"][0]
    own = copy.deepcopy(v2)  # optional: a DDP rank's own buffers (checkpoint/replica.py)
    replica = {"buffers_sha256": "ab", "forward_sync": False, "buffers": {"bn.running_mean": torch.arange(3.0)}}
    own["ranks"][0]["replica"] = replica
    parsed = Entry.from_dict(seal_entry(own)).to_dict()["ranks"][0]["replica"]
    assert (parsed["forward_sync"], parsed["buffers"]["bn.running_mean"].tolist()) == (False, [0.0, 1.0, 2.0])
    assert "replica" not in Entry.from_dict(v2).to_dict()["ranks"][0]
    cycling = copy.deepcopy(v2)  # optional: the rank's loaders that ran out in a cycling epoch (0 kept: it is one)
    for mask in (0, 2):
        cycling["ranks"][0]["ran_out"] = mask
        assert Entry.from_dict(seal_entry(cycling)).to_dict()["ranks"][0]["ran_out"] == mask
    assert "ran_out" not in Entry.from_dict(v2).to_dict()["ranks"][0]


def test_v1_with_other_ranks_gives_each_rank_its_part() -> None:
    """A two-rank version 1 entry, laid out as the old ``gather_ranks`` wrote it: rank 0 on top, rank 1 beside."""
    v1 = _v1()
    other = {key: copy.deepcopy(v1[key]) for key in Entry.from_dict(v1).ranks[0].to_dict()}
    other["batches"] = 7
    v1["other_ranks"] = [other]
    v1["topology"] = {**v1["topology"], "world_size": 2}
    seal_entry(v1)
    entry = Entry.from_dict(v1)
    assert [part.batches for part in entry.ranks] == [3, 7]
    first = parse_entry(v1, seed=13, rank=0, world_size=2)
    second = parse_entry(v1, seed=13, rank=1, world_size=2)
    assert first is not None
    assert second is not None
    assert (first.batches, second.batches) == (3, 7)
    # the shared values reach every rank: a due validation or the rest of a hook is a collective decision
    assert first.environment == second.environment == v1["environment"]
    assert first.trainer_metrics
    assert second.trainer_metrics == first.trainer_metrics
    assert second.pending == first.pending
    assert second.remainder == first.remainder


def _two_ranks_with_own_metrics() -> dict[str, Any]:
    """A two-rank version 2 entry whose rank 1 part holds its own trainer metrics and pending log row (DDP)."""
    entry = _v2()
    other = copy.deepcopy(entry["ranks"][0])
    entry["ranks"].append(other)
    entry["topology"] = {**entry["topology"], "world_size": 2}
    entry["pending"] = {"log": {"loss_step": torch.tensor(0.5)}, "validate": True}
    entry["callback_metrics"] = {name: {"loss": torch.tensor(0.5)} for name in entry["callback_metrics"]}
    other["pending_log"] = {"loss_step": torch.tensor(0.25)}
    other["callback_metrics"] = {name: {"loss": torch.tensor(0.25)} for name in entry["callback_metrics"]}
    entry["manifest"] = {"code": {"git_commit": "c"}, "environment": {"pythonhashseed": None}, "hardware": {"cpu": "A"}}
    other["own_manifest"] = {"environment": {"pythonhashseed": "13"}, "hardware": {"cpu": "B"}}
    return seal_entry(entry)


def test_each_rank_gets_its_own_trainer_metrics_log_row_and_environment() -> None:
    """Under DDP each rank > 0 keeps its own ``callback_metrics`` & co. and pending log row (values logged without
    ``sync_dist`` differ by rank), and its manifest's environment and hardware; the due validation stays the shared
    decision. An entry without them (written before) gives rank 0's to every rank."""
    entry = _two_ranks_with_own_metrics()
    written = Entry.from_dict(entry).to_dict()
    assert float(written["ranks"][1]["pending_log"]["loss_step"]) == 0.25  # round trip
    assert "pending_log" not in written["ranks"][0]
    first = parse_entry(entry, seed=13, rank=0, world_size=2)
    second = parse_entry(entry, seed=13, rank=1, world_size=2)
    assert first is not None
    assert second is not None
    assert float(first.trainer_metrics["_callback_metrics"]["loss"]) == 0.5
    assert float(second.trainer_metrics["_callback_metrics"]["loss"]) == 0.25
    assert (float(first.pending["log"]["loss_step"]), float(second.pending["log"]["loss_step"])) == (0.5, 0.25)
    assert first.pending["validate"] is second.pending["validate"] is True
    assert first.manifest == entry["manifest"]  # rank 1: its own environment and hardware, the shared code
    assert second.manifest == {**entry["manifest"], **entry["ranks"][1]["own_manifest"]}
    assert second.manifest["hardware"] == {"cpu": "B"}
    assert entry["pending"]["log"]["loss_step"] == 0.5  # the entry is left as it was
    for key in ("pending_log", "callback_metrics", "own_manifest"):
        del entry["ranks"][1][key]
    old = parse_entry(seal_entry(entry), seed=13, rank=1, world_size=2)
    assert old is not None
    assert old.manifest == entry["manifest"]
    assert float(old.trainer_metrics["_callback_metrics"]["loss"]) == 0.5
    assert float(old.pending["log"]["loss_step"]) == 0.5


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("pending_log", {"loss_step": 0.25}, "a rank's 'pending_log' is malformed"),
        ("callback_metrics", {"_callback_metrics": {"loss": 1}}, "a rank's 'callback_metrics' is malformed"),
        ("callback_metrics", [], "a rank's 'callback_metrics' is malformed"),
        ("own_manifest", {"hardware": "cpu"}, "a rank's 'own_manifest' is malformed"),
    ],
)
def test_a_damaged_rank_metrics_record_is_refused(key: str, value: Any, message: str) -> None:
    entry = _two_ranks_with_own_metrics()
    entry["ranks"][1][key] = value
    with pytest.raises(CorruptStateError, match=message):
        Entry.from_dict(seal_entry(entry))


def _damage(path: tuple[Any, ...], value: Any = None, *, drop: bool = False) -> Any:
    def edit(entry: dict[str, Any]) -> None:
        target: Any = entry
        for key in path[:-1]:
            target = target[key]
        if drop:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return edit


DAMAGE = [
    ("version-missing", _damage(("version",), drop=True), CorruptStateError, "'version' is missing"),
    ("version-newer", _damage(("version",), 3), ReproError, "has version 3, this lightning-repro reads up to 2"),
    ("seed-str", _damage(("seed",), "13"), CorruptStateError, "'seed' is a str"),
    ("topology-missing", _damage(("topology",), drop=True), CorruptStateError, "'topology' is missing"),
    ("ranks-not-list", _damage(("ranks",), {}), CorruptStateError, "'ranks' is a dict"),
    ("ranks-count", _damage(("ranks",), []), CorruptStateError, "holds 0 rank\\(s\\) of a world size of 1"),
    ("part-not-dict", _damage(("ranks", 0), 5), CorruptStateError, "a rank's part is a int"),
    ("streams-missing", _damage(("ranks", 0, "streams"), drop=True), CorruptStateError, "'streams' is missing"),
    ("stream-missing", _damage(("ranks", 0, "streams", "python"), drop=True), CorruptStateError, "'python' stream"),
    ("streams-digest", _damage(("ranks", 0, "streams_sha256"), "0" * 64), CorruptStateError, "do not match their"),
    ("batches-float", _damage(("ranks", 0, "batches"), 3.0), CorruptStateError, "'batches' is a float"),
    ("data-offset", _damage(("ranks", 0, "data", 0, "offset"), -1), CorruptStateError, "bad data position"),
    ("iterables", _damage(("ranks", 0, "iterables"), [1]), CorruptStateError, "'iterables' is not a dict"),
    ("metrics", _damage(("ranks", 0, "metrics"), [1]), CorruptStateError, "'metrics', 'logged' or 'grads'"),
    ("grads", _damage(("ranks", 0, "grads"), [1]), CorruptStateError, "'metrics', 'logged' or 'grads'"),
    ("logged", _damage(("ranks", 0, "logged"), {"k": {"value": 1}}), CorruptStateError, "logged value 'k'"),
    ("remainder", _damage(("remainder",), {"hook": "on_fit_end"}), CorruptStateError, "'remainder' is malformed"),
    (
        "remainder-batch-end",
        _damage(("remainder",), {"hook": "on_train_batch_end", "callbacks": [], "batch_idx": -1, "last_batch": True}),
        CorruptStateError,
        "'remainder' is malformed",
    ),
    ("batch-end", _damage(("ranks", 0, "batch_end"), {"why": 1}), CorruptStateError, "'batch_end' holds neither"),
    (
        "validation-metrics",
        _damage(("ranks", 0, "validation_metrics"), ["val_acc", 1]),
        CorruptStateError,
        "'validation_metrics' is not a list of names",
    ),
    ("replica", _damage(("ranks", 0, "replica"), {"buffers_sha256": 1}), CorruptStateError, "'replica' is not"),
    (
        "replica-buffers",
        _damage(("ranks", 0, "replica"), {"buffers_sha256": "", "forward_sync": True, "buffers": {"b": 1.0}}),
        CorruptStateError,
        "'replica' is not a record",
    ),
    ("ran-out", _damage(("ranks", 0, "ran_out"), -1), CorruptStateError, "'ran_out' is not a mask"),
    ("ran-out-type", _damage(("ranks", 0, "ran_out"), True), CorruptStateError, "'ran_out' is not a mask"),
    ("callback-metrics", _damage(("callback_metrics",), {"x": 1}), CorruptStateError, "'callback_metrics' is"),
    ("pending", _damage(("pending",), {"validate": 1}), CorruptStateError, "'pending' is malformed"),
    (
        "save-guards",
        _damage(("save_guards",), [{"state_key": "k", "index": 0, "step": "2", "file": ""}]),
        CorruptStateError,
        "'save_guards' is malformed",
    ),
    ("frozen", _damage(("frozen",), ["net.0.weight", 3]), CorruptStateError, "'frozen' is malformed"),
]


@pytest.mark.parametrize(("edit", "error", "message"), [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_every_damaged_part_is_refused_with_its_message(edit: Any, error: type[Exception], message: str) -> None:
    entry = _v2()
    assert Entry.from_dict(entry).seed == 13  # the undamaged entry is accepted
    edit(entry)
    seal_entry(entry)  # a consistent SHA-256, so the check of the damaged part itself is reached
    with pytest.raises(error, match=message):
        Entry.from_dict(entry)


def test_v1_other_ranks_not_a_list_is_refused() -> None:
    entry = _v1()
    entry["other_ranks"] = {"1": {}}
    with pytest.raises(CorruptStateError, match="'other_ranks' is not a list"):
        Entry.from_dict(seal_entry(entry))


@pytest.mark.parametrize("version", [1, 2])
def test_any_edit_without_resealing_is_refused(version: int) -> None:
    entry = _v1() if version == 1 else _v2()
    part = entry if version == 1 else entry["ranks"][0]
    part["data"][0]["offset"] += 1
    with pytest.raises(CorruptStateError, match="does not match its saved SHA-256"):
        Entry.from_dict(entry)


# ---------------------------------------------------------------------------------------- the topology policy
def test_another_seed_is_refused() -> None:
    with pytest.raises(SeedMismatchError, match="written with seed 13 but DeterminismCallback has seed 12"):
        parse_entry(_v2(), seed=12)


def test_topology_change_is_an_error_by_default() -> None:
    with pytest.raises(TopologyError, match=r"world size 1 \(1 node\(s\)\) but this run has world size 2"):
        parse_entry(_v2(), seed=13, rank=1, world_size=2)


def test_topology_change_reseeds_deterministically_when_asked() -> None:
    entry = _v2()
    saved = entry["ranks"][0]["streams_sha256"]
    with pytest.warns(NotExactWarning, match="on_topology_change='reseed'"):
        states = [
            parse_entry(entry, seed=13, rank=rank, world_size=2, on_topology_change="reseed") for rank in (0, 1, 1)
        ]
    assert all(state is not None and state.remap for state in states)
    digests = [digest_process_streams(state.streams) for state in states if state is not None]
    assert digests[1] == digests[2]  # a function of (seed, topology, rank, position)
    assert len({saved, digests[0], digests[1]}) == 3  # every rank re-seeded, each differently


def test_same_ranks_on_other_nodes_continue_without_reseed() -> None:
    state = parse_entry(_v2(), seed=13, world_size=1, num_nodes=2, on_topology_change="reseed")
    assert state is not None
    assert not state.remap
    assert digest_process_streams(state.streams) == _v2()["ranks"][0]["streams_sha256"]


# ---------------------------------------------------------------------------------------- the environment diff
def test_environment_changes_name_each_difference() -> None:
    saved = {"torch": "2.6.0", "cuda": "12.4", "threads": "8"}
    current = {"torch": "2.7.0", "cuda": "12.4", "gpu": "H100"}
    drift = environment_drift(saved, current)
    assert [str(change) for change in drift.changes] == [
        "gpu: '(absent)' -> 'H100'",
        "threads: '8' -> '(absent)'",
        "torch: '2.6.0' -> '2.7.0'",
    ]
    assert drift.breaks  # a checkpoint without a manifest: every change of its fingerprint can break continuation
    assert environment_drift(current, current).changes == ()


# ---------------------------------------------------------------------------------------- the counter corrections
def _progress(ready: int, completed: int) -> dict[str, int]:
    return {"ready": ready, "started": ready, "processed": ready, "completed": completed}


def _checkpoint(*, ready: int, completed: int, epoch_started: int, epoch_processed: int) -> dict[str, Any]:
    epoch = {"ready": epoch_started, "started": epoch_started, "processed": epoch_processed, "completed": 0}
    epoch["completed"] = epoch_processed
    fit = {
        "epoch_progress": {"total": dict(epoch), "current": dict(epoch)},
        "epoch_loop.batch_progress": {
            "total": _progress(ready, completed),
            "current": _progress(ready, completed),
            "is_last_batch": True,
        },
        "epoch_loop.state_dict": {"_batches_that_stepped": ready},
    }
    return {"epoch": epoch_processed, "loops": {"fit_loop": fit}}


def _facts(total: int, accumulate: int = 1, truncated: bool = False) -> dict[str, Any]:
    return {"truncated": truncated, "loops": {"num_training_batches": total, "accumulate_grad_batches": accumulate}}


def test_counters_without_our_entry_stay_as_lightning_wrote_them() -> None:
    checkpoint = _checkpoint(ready=8, completed=7, epoch_started=1, epoch_processed=0)
    before = copy.deepcopy(checkpoint)
    fix_loop_progress(checkpoint, None)
    fix_loop_progress(checkpoint, {"truncated": True})  # an entry without loop facts (written before them)
    assert checkpoint == before


@pytest.mark.parametrize("validate", [False, True], ids=["no-validation-due", "validation-due"])
def test_last_batch_checkpoint_resumes_on_the_last_batch(validate: bool) -> None:
    """Marked "on the last batch"; the last batch's step is counted for the logger (``_batches_that_stepped``, not
    yet counted when the file was written) unless the epoch-end validation is due: then Lightning's restart goes
    through ``on_advance_end`` again and counts it itself."""
    checkpoint = _checkpoint(ready=8, completed=7, epoch_started=1, epoch_processed=0)
    expected = copy.deepcopy(checkpoint)
    for part in ("total", "current"):
        expected["loops"]["fit_loop"]["epoch_loop.batch_progress"][part]["completed"] = 8
    expected["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] = 8 if validate else 9
    fix_loop_progress(checkpoint, {**_facts(total=8), "pending": {"log": None, "validate": validate}})
    assert checkpoint == expected


def test_mid_epoch_checkpoint_is_left_alone() -> None:
    checkpoint = _checkpoint(ready=5, completed=4, epoch_started=1, epoch_processed=0)
    before = copy.deepcopy(checkpoint)
    fix_loop_progress(checkpoint, _facts(total=8))
    assert checkpoint == before


@pytest.mark.parametrize(("ready", "accumulate", "stepped"), [(4, 1, 3), (4, 2, 3), (3, 2, 3)])
def test_epoch_cut_short_resumes_in_its_middle(ready: int, accumulate: int, stepped: int) -> None:
    # max_steps reached after `ready` batches: Lightning marked the epoch processed and the batch completed
    checkpoint = _checkpoint(ready=ready, completed=ready, epoch_started=1, epoch_processed=1)
    fix_loop_progress(checkpoint, _facts(total=8, accumulate=accumulate, truncated=True))
    fit = checkpoint["loops"]["fit_loop"]
    for part in ("total", "current"):
        assert fit["epoch_progress"][part]["processed"] == fit["epoch_progress"][part]["completed"] == 0
        assert fit["epoch_loop.batch_progress"][part]["completed"] == ready - 1
    assert checkpoint["epoch"] == 0
    assert fit["epoch_loop.batch_progress"]["is_last_batch"] is False
    # the last batch's optimizer step is counted again on resume, unless it fell inside an accumulation window
    assert fit["epoch_loop.state_dict"]["_batches_that_stepped"] == (stepped if ready % accumulate == 0 else ready)


# ---------------------------------------------------------------------------------------- a v1 checkpoint resumes
def test_v1_checkpoint_resumes_like_the_uninterrupted_run(tmp_path: Path) -> None:
    """A version 1 entry written on this machine (an entry of today laid out as version 1) resumes bitwise."""
    from test_callback import _fit_counting  # tests/ is on sys.path (conftest.py)

    uninterrupted, reference = _fit_counting()
    _fit_counting(save=tmp_path / "v2.ckpt")  # step 3, as the fixture
    v1 = helpers.as_v1_checkpoint(tmp_path / "v2.ckpt", tmp_path / "v1.ckpt")
    entry = torch.load(v1, weights_only=True)["callbacks"]["DeterminismCallback"]
    assert sorted(entry) == sorted(_v1())  # the layout the version 1 code wrote
    assert Entry.from_dict(entry).version == 1
    with pytest.warns(ReproWarning, match="Hardware not recorded: .*without blas_build, cpu_capability, cpu_model"):
        resumed, model = _fit_counting(ckpt=v1)  # any other warning (a drift) fails the test
    assert resumed.callbacks[0].restored  # type: ignore[attr-defined]
    assert resumed.global_step == uninterrupted.global_step == 8
    assert torch.equal(resumed.callback_metrics["positives"], uninterrupted.callback_metrics["positives"])
    assert digest_tensors(model.state_dict()) == digest_tensors(reference.state_dict())


@pytest.mark.parametrize("their_grads", [0, 50_000], ids=["one-round", "two-rounds"])
def test_gather_ranks_puts_each_rank_in_its_place_and_leaves_the_entry_alone(
    monkeypatch: pytest.MonkeyPatch, their_grads: int
) -> None:
    """The parts travel in one ``all_gather`` (size and payload) while every packed part fits in 64 KiB, else in two."""
    import struct

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from lightning_repro.checkpoint.encoding import encode
    from lightning_repro.checkpoint.gather import pack_part
    from lightning_repro.checkpoint.save import gather_ranks

    mine = Entry.from_dict(_v2())
    theirs = copy.deepcopy(mine.ranks[0].to_dict())
    theirs["batches"] = 9
    theirs["grads"] = {"w": torch.arange(their_grads, dtype=torch.float32)} if their_grads else None
    payload = pack_part(theirs, encode(theirs))  # rank 1's, as rank 1 packs it
    rounds: list[int] = []

    def all_gather(out: list[torch.Tensor], sent: torch.Tensor) -> None:  # rank 1's buffer as rank 1 builds it
        if not rounds:
            capacity = sent.numel() - 8
            fits = payload if len(payload) <= capacity else b""
            other = struct.pack("<q", len(payload)) + fits + bytes(capacity - len(fits))
        else:
            other = payload + bytes(sent.numel() - len(payload))
        rounds.append(sent.numel())
        out[0].copy_(sent)
        out[1].copy_(torch.frombuffer(bytearray(other), dtype=torch.uint8))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(distributed_c10d, "_get_object_coll_device", lambda: "cpu")
    trainer: Any = helpers.gather_trainer(2)
    gathered = gather_ranks(mine, trainer)
    assert len(rounds) == (2 if their_grads else 1)
    assert [part.batches for part in gathered.ranks] == [3, 9]
    assert gathered.ranks[0].to_dict().keys() == {*mine.ranks[0].to_dict(), "replica"}
    assert gathered.ranks[0].replica == {"buffers_sha256": ""}  # a module without buffers (checkpoint/replica.py)
    if their_grads:
        grads = gathered.ranks[1].grads
        assert grads is not None
        assert torch.equal(grads["w"], theirs["grads"]["w"])
    assert [part.batches for part in mine.ranks] == [3]  # gathered again at the next checkpoint of the same step
    rounds.clear()
    assert [part.batches for part in gather_ranks(mine, trainer).ranks] == [3, 9]


# ---------------------------------------------------------------------------------------- the layout of 0.2
def _pickled_globals(path: Path) -> set[str]:
    """The ``module.name`` globals a checkpoint file's pickle refers to (what loading it imports)."""
    import pickletools
    import zipfile

    names: set[str] = set()
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(str(arg))
        elif opcode.name == "GLOBAL":
            names.add(str(arg).replace(" ", "."))
        elif opcode.name == "STACK_GLOBAL":
            names.add(f"{strings[-2]}.{strings[-1]}")
    return names


def test_checkpoints_name_no_module_of_ours_so_the_layout_may_move(tmp_path: Path) -> None:
    """A checkpoint written before the package's modules moved (the fixture) reads as before; none refers to them.

    The entry holds tensors and plain values only, so neither the file of an older version nor one written now
    imports a ``lightning_repro`` module when it is loaded: moving modules cannot break a saved checkpoint.
    """
    from test_callback import _fit_counting  # tests/ is on sys.path (conftest.py)

    _fit_counting(save=tmp_path / "now.ckpt")
    for path in (V1_CHECKPOINT, tmp_path / "now.ckpt"):
        found = _pickled_globals(path)
        assert found, "the scan sees the pickle's globals at all (torch's rebuild functions)"
        assert not [name for name in found if name.startswith("lightning_repro")], (path, found)
    parsed = parse_entry(_v2(), seed=13, rank=0, world_size=1, num_nodes=1, on_topology_change="error")
    assert parsed is not None
    assert parsed.data[0]["offset"] == 3  # the pre-move entry parses with the moved code
    probe = tmp_path / "probe.ckpt"
    torch.save({"x": Entry}, probe)  # a file that does refer to a class of ours: the scan finds it
    assert "lightning_repro.checkpoint.entry.Entry" in _pickled_globals(probe)
