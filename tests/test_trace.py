"""The step trace: its file, its diff, the four injected faults, the entry's tail and the continuation check."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import fast_trainer
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset, Sampler
from trace_run import Model as Tiny

from lightning_repro import DeterminismCallback, InputError, NotExactWarning, ReproWarning, diff_traces
from lightning_repro.callback import DEFAULT_TRACE_PARAMS_EVERY
from lightning_repro.checkpoint.entry import entry_digest
from lightning_repro.trace import (
    Trace,
    TraceRecord,
    TraceWriter,
    decode_loss,
    encode_loss,
    read_trace,
    read_trace_file,
    trace_file_name,
)
from lightning_repro.trace.digest import device_checksum

STEPS = 6


# ---------------------------------------------------------------------------------------------- a tiny traced fit
class Augmented(Dataset):  # type: ignore[type-arg]
    """24 samples with augmentation from the (keyed) torch stream; ``unseeded`` adds a draw from a fresh Random()."""

    def __init__(self, unseeded: bool = False) -> None:
        self.unseeded = unseeded

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), i / 24) + 0.1 * torch.randn(4)
        if self.unseeded:
            x = x + random.Random().random()  # seeded from os.urandom: differs in every run
        return x, torch.tensor([float(i % 3)])


class UrandomOrder(Sampler[int]):
    """A sampler whose order comes from ``os.urandom``: it changes between runs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return iter(sorted(range(self.n), key=lambda _: os.urandom(4)))


class ManualTiny(Tiny):
    """Manual optimisation: an optimizer step every second batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            optimizer = self.optimizers()
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]
        return loss


class Reseed(Callback):
    """Re-seeds torch's global stream at the end of step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            torch.manual_seed(123)


def traced_fit(
    path: Path,
    *,
    model: Callable[[], pl.LightningModule] = Tiny,
    dataset: Dataset | None = None,  # type: ignore[type-arg]
    sampler: Sampler[int] | None = None,
    callbacks: list[Callback] = (),  # type: ignore[assignment]
    **trainer_kwargs: Any,
) -> tuple[Trace, DeterminismCallback, pl.Trainer]:
    repro = DeterminismCallback(5, trace=path, trace_params_every=2)
    data = dataset or Augmented()
    loader = DataLoader(data, batch_size=4, sampler=sampler, shuffle=None if sampler else True)
    trainer = fast_trainer([repro, *callbacks], **{"max_steps": STEPS, **trainer_kwargs})
    trainer.fit(model(), loader)
    return read_trace_file(path), repro, trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return traced_fit(tmp_path_factory.mktemp("reference") / "trace.jsonl")[0]


def test_a_fit_writes_one_record_per_step(reference: Trace) -> None:
    assert [r.step for r in reference.records] == list(range(1, STEPS + 1))
    assert [(r.epoch, r.batch) for r in reference.records] == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5)]
    first = reference.records[0]
    assert first.indices
    assert first.data
    assert first.streams
    assert [r.params is not None for r in reference.records] == [False, True] * 3  # every 2nd step
    assert first.loss
    assert decode_loss(first.loss) is not None
    assert decode_loss(first.loss) > 0
    assert len({r.indices for r in reference.records}) == STEPS  # each step other samples
    assert len({r.streams for r in reference.records}) == STEPS  # dropout draws move the streams
    assert reference.runs[0].header["resumed_from_step"] is None


def test_the_same_run_twice_gives_the_same_trace(reference: Trace, tmp_path: Path) -> None:
    again, _, _ = traced_fit(tmp_path / "again.jsonl")
    assert again.records == reference.records
    assert not diff_traces(reference, again).diverged


# ---------------------------------------------------------------------------------------------- injected faults
@pytest.mark.filterwarnings("ignore:UrandomOrder is not a sampler lightning-repro knows:lightning_repro.ReproWarning")
@pytest.mark.parametrize(
    ("fault", "step", "field", "cause"),
    [
        ("noise", 3, "loss", "numerics"),
        ("unseeded-dataset", 1, "data", "data-content"),
        ("urandom-sampler", 1, "indices", "data-order"),
        ("reseed", 4, "streams", "rng"),
    ],
)
def test_an_injected_fault_is_found_and_named(
    reference: Trace, tmp_path: Path, fault: str, step: int, field: str, cause: str
) -> None:
    kwargs: dict[str, Any] = {
        "noise": {"model": lambda: Tiny(noise_from=3)},  # built after the callback seeded, as the reference's
        "unseeded-dataset": {"dataset": Augmented(unseeded=True)},
        "urandom-sampler": {"sampler": UrandomOrder(24)},
        "reseed": {"callbacks": [Reseed(at=3)]},
    }[fault]
    if fault == "urandom-sampler":
        # the reference runs a shuffled RandomSampler: a clean run of this sampler, twice, is the real comparison
        reference = traced_fit(tmp_path / "clean.jsonl", sampler=UrandomOrder(24))[0]
    faulty, _, _ = traced_fit(tmp_path / "faulty.jsonl", **kwargs)
    found = diff_traces(reference, faulty)
    assert (found.first_divergent_step, found.field, found.cause) == (step, field, cause)
    assert found.last_equal_step == (step - 1 if step > 1 else None)
    assert found.common_steps == STEPS
    mirrored = diff_traces(faulty, reference)
    assert (mirrored.first_divergent_step, mirrored.field, mirrored.cause) == (step, field, cause)


# ---------------------------------------------------------------------------------------------- accumulation, manual
def test_gradient_accumulation_writes_one_record_per_optimizer_step(reference: Trace, tmp_path: Path) -> None:
    trace, _, _ = traced_fit(tmp_path / "accumulate.jsonl", max_steps=3, accumulate_grad_batches=2)
    assert [(r.step, r.batch) for r in trace.records] == [(1, 1), (2, 3), (3, 5)]
    assert all(len((r.loss or "").split(",")) == 2 for r in trace.records)  # the bits of both batches' losses
    # the step covers both of its batches: its indices are not those of its last batch alone
    assert trace.records[0].indices not in {r.indices for r in reference.records}


def test_manual_optimisation_writes_one_record_per_optimizer_step(tmp_path: Path) -> None:
    trace, _, _ = traced_fit(tmp_path / "manual.jsonl", model=ManualTiny, max_steps=2)
    assert [(r.step, r.batch) for r in trace.records] == [(1, 1), (2, 3)]


def test_the_checkpoint_entry_holds_the_trace_tail(tmp_path: Path) -> None:
    trace, repro, trainer = traced_fit(tmp_path / "t.jsonl")
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    entry = checkpoint["callbacks"][repro.state_key]
    tail = entry["ranks"][0]["trace"]
    assert [TraceRecord.from_dict(r) for r in tail] == list(trace.records[-len(tail) :])
    sealed = entry_digest(entry)
    tail[-1]["loss"] = encode_loss(0.5)
    assert entry_digest(entry) != sealed  # the seal covers the tail


def test_trace_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"`on_divergence` must be 'warn' or 'error', got 'raise'"):
        DeterminismCallback(1, on_divergence="raise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`trace_params_every` must be an int >= 1 .* got 0"):
        DeterminismCallback(1, trace=True, trace_params_every=0)
    with pytest.raises(TypeError, match=r"`trace` must be True, a path or None, got 3"):
        DeterminismCallback(1, trace=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`trace_params_every` must be an int >= 1 .* got '10'"):
        DeterminismCallback(1, trace=True, trace_params_every="10")  # type: ignore[arg-type]
    for empty in ("", " "):  # it wrote trace.jsonl files into the current directory
        with pytest.raises(ValueError, match=r"`trace` is an empty path"):
            DeterminismCallback(1, trace=empty)
    for off in (None, False):  # a configuration that switched the trace off: said, not silent, nor an error
        said = rf"`trace_params_every=5` has no effect: the step trace is off \(trace={off}\)"
        with pytest.warns(ReproWarning, match=said):
            assert DeterminismCallback(1, trace=off, trace_params_every=5).tracer is None
    assert DeterminismCallback(1, on_divergence="error").on_divergence == "error"
    assert DeterminismCallback(1).tracer is None
    tracer = DeterminismCallback(1, trace=True).tracer
    assert tracer is not None
    assert tracer.params_every == DEFAULT_TRACE_PARAMS_EVERY == 10


# ---------------------------------------------------------------------------------------------- file format
def _records(n: int, rank: int = 0, loss: str = "a") -> list[TraceRecord]:
    return [
        TraceRecord(s, 0, s - 1, rank, indices=f"i{s}", data=f"d{s}", loss=f"{loss}{s}", streams="s")
        for s in range(1, n + 1)
    ]


def test_a_record_as_a_dict_holds_every_field_in_order() -> None:
    import dataclasses

    record = TraceRecord(7, 1, 3, 2, indices="i", data="d", loss="l", streams="s", params="p")
    assert list(record.to_dict().items()) == list(dataclasses.asdict(record).items())
    assert TraceRecord.from_dict(record.to_dict()) == record


def test_writer_and_reader_round_trip_with_a_resumed_run(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path)
    writer.header(rank=0, resumed_from_step=None)
    for record in _records(5):
        writer.write(record)
    writer.close()
    writer = TraceWriter(path)
    writer.header(rank=0, resumed_from_step=3)
    for record in _records(6, loss="b")[3:]:
        writer.write(record)
    writer.close()
    trace = read_trace_file(path)
    assert [r.loss for r in trace.records] == ["a1", "a2", "a3", "b4", "b5", "b6"]
    assert [len(run.records) for run in trace.runs] == [5, 3]
    assert trace.runs[1].resumed_from_step == 3
    assert read_trace(tmp_path)[0].records == trace.records  # a directory of one file


def test_a_torn_last_line_is_dropped_with_a_note_and_cut_by_the_next_writer(tmp_path: Path) -> None:
    path = tmp_path / "trace-rank0.jsonl"
    lines = [json.dumps(r.to_dict()) for r in _records(3)]
    path.write_text("\n".join(lines) + "\n" + lines[0][:17])  # killed while writing a line
    trace = read_trace_file(path)
    assert [r.step for r in trace.records] == [1, 2, 3]
    assert len(trace.notes) == 1
    assert "torn last line 4" in trace.notes[0]
    writer = TraceWriter(path)
    assert writer.cut == 17
    writer.write(_records(4)[3])
    writer.close()
    assert [r.step for r in read_trace_file(path).records] == [1, 2, 3, 4]


def test_a_malformed_line_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [json.dumps(r.to_dict()) for r in _records(3)]
    lines[1] = lines[1].replace('"epoch":', '"epoch": "zero", "x":')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"t\.jsonl, line 2: not a trace record") as caught:
        read_trace_file(path)
    assert "\n" not in str(caught.value)
    with pytest.raises(InputError, match="no such trace file"):
        read_trace(tmp_path / "missing.jsonl")


def test_trace_file_names_per_rank(tmp_path: Path) -> None:
    assert trace_file_name(tmp_path / "t.jsonl", 0, 2) == tmp_path / "t.jsonl"
    assert trace_file_name(tmp_path / "t.jsonl", 1, 2) == tmp_path / "t-rank1.jsonl"
    assert trace_file_name(tmp_path, 3, 4) == tmp_path / "trace-rank3.jsonl"


def test_device_checksum_is_exact_on_bit_patterns() -> None:
    a = torch.tensor([0.0, 1.0, 2.0])
    assert torch.equal(device_checksum(a), device_checksum(a.clone()))
    assert not torch.equal(device_checksum(a), device_checksum(torch.tensor([-0.0, 1.0, 2.0])))  # sign bit only
    assert not torch.equal(device_checksum(a), device_checksum(torch.tensor([1.0, 0.0, 2.0])))  # a swap


_VALID = "".join(json.dumps(r.to_dict()) + "\n" for r in _records(4))


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_malformed_files_raise_input_error_only(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    path = tmp_path_factory.mktemp("malformed") / "t.jsonl"
    path.write_bytes(content)
    try:
        read_trace_file(path)
    except InputError as error:
        message = str(error)
    else:
        return
    assert "\n" not in message
    assert str(path) in message


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(_VALID.encode())))
def test_truncated_files_keep_their_complete_lines(tmp_path_factory: pytest.TempPathFactory, cut: int) -> None:
    path = tmp_path_factory.mktemp("truncated") / "t.jsonl"
    raw = _VALID.encode()[:cut]
    path.write_bytes(raw)
    trace = read_trace_file(path)
    assert [r.step for r in trace.records] == list(range(1, raw.count(b"\n") + 1))
    assert len(trace.notes) == (0 if raw.endswith(b"\n") or not raw else 1)
    path.write_bytes(raw + b"\n{not json}\n")  # a complete malformed line is an error, wherever it is
    with pytest.raises(InputError, match=r"line \d+: not a trace record"):
        read_trace_file(path)


_FIELD_VALUES = st.sampled_from(["x", "y", None])


@st.composite
def _trace_pair(draw: Any) -> tuple[list[TraceRecord], list[TraceRecord]]:
    def records(steps: list[int]) -> list[TraceRecord]:
        return [
            TraceRecord(s, 0, s, indices=draw(_FIELD_VALUES), data=draw(_FIELD_VALUES), loss=draw(_FIELD_VALUES),
                        streams=draw(_FIELD_VALUES), params=draw(_FIELD_VALUES))
            for s in steps
        ]  # fmt: skip

    steps = st.lists(st.integers(1, 12), unique=True, max_size=8)
    return records(sorted(draw(steps))), records(sorted(draw(steps)))


@settings(max_examples=80, deadline=None)
@given(_trace_pair())
def test_diff_is_symmetric(pair: tuple[list[TraceRecord], list[TraceRecord]]) -> None:
    a, b = pair
    ab, ba = diff_traces(a, b), diff_traces(b, a)
    keys = ("first_divergent_step", "last_equal_step", "field", "cause", "common_steps")
    assert {k: ab.to_dict()[k] for k in keys} == {k: ba.to_dict()[k] for k in keys}
    assert (ab.only_a, ab.only_b) == (ba.only_b, ba.only_a)


# ------------------------------------------------------------------------------------- resumed in a fresh process
RUN = Path(__file__).with_name("trace_run.py")


def _trace_run(cfg: dict[str, Any], *, expect: int = 0) -> str:
    import runner

    code, _, stderr = runner.execute([str(RUN), json.dumps(cfg)])
    assert code == expect, stderr[-4000:]
    return stderr


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run checkpointed at step 3 and killed hard after step 5: its trace holds steps 1..5."""
    import runner

    out = tmp_path_factory.mktemp("interrupted")
    _trace_run({"out": str(out), "kill_after": 5}, expect=runner.KILLED)
    return out


def _copy(interrupted: Path, tmp_path: Path) -> Path:
    shutil.copytree(interrupted, tmp_path / "interrupted")
    return tmp_path / "interrupted" / "ckpt"


@pytest.mark.slow
def test_a_resume_after_a_hard_kill_verifies_the_overlap(interrupted: Path, tmp_path: Path) -> None:
    ckpt = _copy(interrupted, tmp_path)
    assert [r.step for r in read_trace_file(ckpt / "trace-rank0.jsonl").records] == [1, 2, 3, 4, 5]
    stderr = _trace_run({"out": str(tmp_path / "resumed"), "resume": str(ckpt / "epoch=0-step=3.ckpt")})
    assert "continuation verified: steps 4..5 bitwise" in stderr
    assert json.loads((tmp_path / "resumed" / "result.json").read_text()) == {"continuation": "verified"}
    trace = read_trace_file(ckpt / "trace-rank0.jsonl")  # the resumed run appended to the interrupted trace
    assert [r.step for r in trace.records] == list(range(1, 9))
    assert [run.resumed_from_step for run in trace.runs] == [None, 3]


@pytest.mark.slow
def test_a_fault_after_the_resume_is_reported_at_its_step(interrupted: Path, tmp_path: Path) -> None:
    ckpt = _copy(interrupted, tmp_path)
    cfg = {"out": str(tmp_path / "resumed"), "resume": str(ckpt / "epoch=0-step=3.ckpt"), "noise_from": 5}
    stderr = _trace_run({**cfg, "on_divergence": "error"}, expect=1)
    assert "DivergenceError" in stderr
    assert "at step 5 (steps 4..4 agree): field 'loss' differs first, likely cause numerics" in stderr


@pytest.mark.slow
def test_a_data_position_off_by_one_epoch_is_caught_at_the_first_resumed_step(
    interrupted: Path, tmp_path: Path
) -> None:
    from lightning_repro.checkpoint.entry import seal_entry

    ckpt = _copy(interrupted, tmp_path)
    path = ckpt / "epoch=0-step=3.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    entry = checkpoint["callbacks"]["DeterminismCallback"]
    entry["ranks"][0]["data"][0]["epoch"] += 1  # the early-loader bug: the position of the wrong epoch
    torch.save({**checkpoint, "callbacks": {"DeterminismCallback": seal_entry(entry)}}, path)
    cfg = {"out": str(tmp_path / "resumed"), "resume": str(path), "on_divergence": "error"}
    # the restore check sees it first: the position restored is not the one whose digest was saved
    stderr = _trace_run(cfg, expect=1)
    assert "RestoreError" in stderr
    assert "data position" in stderr
    # a position wrong already when it was saved (digest and position agree): the continuation check catches it
    entry.pop("entry_sha256")
    del entry["ranks"][0]["restore_sha256"]
    torch.save({**checkpoint, "callbacks": {"DeterminismCallback": seal_entry(entry)}}, path)
    stderr = _trace_run({**cfg, "out": str(tmp_path / "resumed-2")}, expect=1)
    assert "DivergenceError" in stderr
    assert "at step 4 (no resumed step agrees): field 'indices' differs first, likely cause data-order" in stderr


def test_a_divergence_warns_by_default(tmp_path: Path) -> None:
    """In process: a resume whose trace file holds other records past the checkpoint warns (on_divergence='warn')."""
    trace, _repro, trainer = traced_fit(tmp_path / "t.jsonl", max_steps=3)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    with (tmp_path / "t.jsonl").open("a") as f:  # the interrupted run's step 4, as another run would have had it
        f.write(json.dumps({**trace.records[-1].to_dict(), "step": 4, "batch": 3}) + "\n")
    again = DeterminismCallback(5, trace=tmp_path / "t.jsonl")
    loader = DataLoader(Augmented(), batch_size=4, shuffle=True)
    with pytest.warns(UserWarning, match=r"at step 4 .* field 'indices' differs first, likely cause data-order"):
        fast_trainer([again], max_steps=5).fit(Tiny(), loader, ckpt_path=tmp_path / "step3.ckpt")
    assert again.tracer is not None
    assert again.tracer.continuation == "diverged"


def test_stream_digest_reads_raw_memory_into_the_public_apis_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw-memory read and the public API give one digest (LIGHTNING_REPRO_*_RAW=0 runs compare equal)."""
    import random

    import numpy as np

    from lightning_repro.trace import digest as _tracedigest

    if _tracedigest.PYTHON_RAW is None or _tracedigest.NUMPY_RAW is None:
        pytest.skip("no checked raw layout in this build: only the public path exists")
    random.gauss(0, 1)  # a cached gaussian in python's and numpy's generators
    np.random.randn()

    def every_path() -> tuple[str, str, str]:
        """The digest through the seeding kernel's capture (where built), the raw reads, the public APIs."""
        kernel = _tracedigest.digest_streams()
        with monkeypatch.context() as m:
            m.setattr(_tracedigest, "NATIVE", None)
            raw = _tracedigest.digest_streams()
            m.setattr(_tracedigest, "PYTHON_RAW", None)
            m.setattr(_tracedigest, "NUMPY_RAW", None)
            return kernel, raw, _tracedigest.digest_streams()

    before = every_path()
    assert len(set(before)) == 1
    for draw in (random.random, np.random.rand, lambda: random.gauss(0, 1), lambda: np.random.randn()):
        draw()
        after = every_path()
        assert len(set(after)) == 1
        assert after[0] != before[0]
        before = after


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_over_0_says_its_divergence_in_its_log(rank: int, caplog: pytest.LogCaptureFixture) -> None:
    """Warnings and the continuation line speak on rank 0 only: a rank > 0 whose resumed steps differ from its
    trace (its own optimizer state, its data) writes the divergence to its log, prefixed with its rank."""
    import logging

    from lightning_repro._warn import WarningCache
    from lightning_repro.trace.records import TraceRecord
    from lightning_repro.trace.tracer import StepTracer

    tracer = StepTracer(True, params_every=1, on_divergence="warn", warnings=WarningCache())
    tracer._rank = rank
    tracer._expected = {5: TraceRecord(step=5, epoch=0, batch=4, rank=rank, loss="a", params="p")}
    with caplog.at_level(logging.WARNING, logger="lightning_repro.trace.tracer"), pytest.warns(NotExactWarning):
        tracer._check(TraceRecord(step=5, epoch=0, batch=4, rank=rank, loss="a", params="q"))  # (this process: rank 0)
    assert tracer.continuation == "diverged"
    logged = [r.getMessage() for r in caplog.records if r.name == "lightning_repro.trace.tracer"]
    if rank:
        [message] = logged
        assert message.startswith("[rank: 1] continuation check: the resumed run differs"), message
        assert "field 'params' differs first" in message
    else:
        assert logged == []


def test_the_line_of_every_ranks_continuation_check() -> None:
    """What rank 0 says at the end of a resumed DDP fit, from every rank's check: verified on every rank (the same
    steps or each its own), a divergence on any rank (with the ranks that agreed, and a warning for a rank > 0 only:
    rank 0 warned of its own), a rank with nothing to compare, no check at all."""
    from lightning_repro.trace.diff import every_rank_continuation

    verified = {"steps": [5, 6]}
    assert every_rank_continuation([verified, verified]) == (
        "continuation verified on every rank (2): steps 5..6 bitwise",
        [],
    )
    assert every_rank_continuation([verified, {"steps": [5, 7]}]) == (
        "continuation verified on every rank (2): rank 0 steps 5..6, rank 1 steps 5..7 bitwise",
        [],
    )
    rank1 = {"diverged": "step 6 differs from the trace t1 in 'loss' (numerics)", "message": "[rank: 1] check 1"}
    assert every_rank_continuation([verified, rank1]) == (
        "continuation NOT verified on every rank: [rank 1] step 6 differs from the trace t1 in 'loss' (numerics);"
        " verified on rank 0 (steps 5..6)",
        ["[rank: 1] check 1"],
    )
    rank0 = {"diverged": "step 5 differs from the trace t0 in 'data' (data-content)", "message": "check 0"}
    assert every_rank_continuation([rank0, rank1, None]) == (
        "continuation NOT verified on every rank: [rank 0] step 5 differs from the trace t0 in 'data' (data-content);"
        " [rank 1] step 6 differs from the trace t1 in 'loss' (numerics); nothing compared on rank 2 (no trace past"
        " the checkpoint to compare with)",
        ["[rank: 1] check 1"],
    )
    assert every_rank_continuation([verified, None]) == (
        "continuation verified on rank 0 only: steps 5..6 bitwise; nothing compared on rank 1 (no trace past the"
        " checkpoint to compare with)",
        [],
    )
    assert every_rank_continuation([None, None]) == (None, [])
    many = [verified] * 6 + [{"steps": [5, 7]}, None, None, None]  # ranks named in spans, not one by one
    assert every_rank_continuation(many) == (
        "continuation verified on ranks 0-6 only: ranks 0-5 steps 5..6, rank 6 steps 5..7 bitwise; nothing compared"
        " on ranks 7-9 (no trace past the checkpoint to compare with)",
        [],
    )
    same = {"diverged": "step 6 differs in 'streams' (rng)", "message": "m"}
    assert every_rank_continuation([verified, same, same, same]) == (
        "continuation NOT verified on every rank: [ranks 1-3] step 6 differs in 'streams' (rng); verified on rank 0"
        " (steps 5..6)",
        ["m (the continuation differs on ranks 2, 3 too)"],  # one warning, not one a rank
    )


def test_one_process_collects_no_line_of_every_rank(caplog: pytest.LogCaptureFixture) -> None:
    """Without a process group (one process, or a DDP checkpoint resumed on one rank) the check is rank 0's line
    alone: no collective, nothing more said; a rank's own line names it under DDP only."""
    from lightning_repro._warn import WarningCache, resume_log
    from lightning_repro.trace.records import TraceRecord
    from lightning_repro.trace.tracer import StepTracer

    tracer = StepTracer(True, params_every=1, on_divergence="warn", warnings=WarningCache())
    tracer._expected = {5: TraceRecord(step=5, epoch=0, batch=4, rank=0, loss="a")}
    with caplog.at_level(logging.INFO, logger=resume_log.name):
        tracer._check(TraceRecord(step=5, epoch=0, batch=4, rank=0, loss="a"))
        assert tracer._outcome == {"steps": [5, 5]}
        tracer._world = 2  # a DDP rank whose group is not initialized here: say_every_rank says nothing
        tracer.say_every_rank()
    said = [r.getMessage() for r in caplog.records if r.name == resume_log.name]
    assert said == ["lightning-repro: continuation verified: steps 5..5 bitwise against the trace None"]
    assert tracer._on_rank() == " on rank 0"  # under DDP a rank's own line names it


def test_a_divergence_after_a_failed_restore_check_names_the_restore(tmp_path: Path) -> None:
    """Weights edited in the file (the entry intact): the continuation check's divergence is the restore's, and it
    says so, rather than 'numerics' and its list of nondeterministic operations."""
    from lightning_repro import NotExactWarning

    path, loader = tmp_path / "t.jsonl", DataLoader(Augmented(), batch_size=4, shuffle=True)
    _, _, trainer = traced_fit(path, max_steps=3)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    fast_trainer([DeterminismCallback(5, trace=path, trace_params_every=2)], max_steps=5).fit(
        Tiny(), loader, ckpt_path=tmp_path / "step3.ckpt"
    )  # the interrupted run's steps 4 and 5
    checkpoint = torch.load(tmp_path / "step3.ckpt", weights_only=True)
    name = next(iter(checkpoint["state_dict"]))
    checkpoint["state_dict"][name] = checkpoint["state_dict"][name] + 1e-3
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    again = DeterminismCallback(5, trace=path, trace_params_every=2)
    with pytest.warns(NotExactWarning) as said:
        fast_trainer([again], max_steps=5).fit(Tiny(), loader, ckpt_path=tmp_path / "edited.ckpt")
    [continuation] = [str(w.message) for w in said if "continuation check" in str(w.message)]
    first = "at step 4 (no resumed step agrees): field 'loss' differs first, likely cause: the restore (restore check"
    assert first in continuation
    assert "parameters differs from what the checkpoint saved; the trace alone reads it as numerics)" in continuation
    assert again.tracer is not None
    assert again.tracer.continuation == "diverged"


class SizedByTheTrainer(Tiny):
    """A OneCycleLR sized by ``estimated_stepping_batches``: the train loader is built (and iterated) early."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_an_early_loader_with_workers_resumed_near_an_epoch_s_end_is_verified(tmp_path: Path) -> None:
    """Workers, accumulation, a mid-epoch checkpoint with fewer batches left than the workers prefetch, a loader
    built early: the early iterator gave the last batch and was made again, the sampler remembered that batch twice,
    and the trace put every later step's indices one batch off ("continuation NOT verified ... data-order" of a run
    that was bitwise the interrupted one, and `diff` exit 1)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(ckpt: Path | None) -> DeterminismCallback:
        repro = DeterminismCallback(5, trace=tmp_path / "t.jsonl")
        saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
        options = {"max_epochs": 3, "accumulate_grad_batches": 2, "enable_checkpointing": True}
        trainer = fast_trainer([repro, saves], default_root_dir=tmp_path, **options)
        loader = DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=2)  # 3 batches an epoch
        trainer.fit(SizedByTheTrainer(), loader, ckpt_path=ckpt)
        return repro

    fit(None)
    shutil.copy(tmp_path / "ckpt" / "epoch=0-step=1.ckpt", tmp_path / "step1.ckpt")
    shutil.rmtree(tmp_path / "ckpt")  # the resumed run writes its own files there
    resumed = fit(tmp_path / "step1.ckpt")  # 2 batches read, 1 left: the workers' prefetch takes it
    assert resumed.tracer is not None
    assert resumed.tracer.continuation == "verified"
    assert [r.step for r in read_trace_file(tmp_path / "t.jsonl").records][-5:] == [2, 3, 4, 5, 6]
