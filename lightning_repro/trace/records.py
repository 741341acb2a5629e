"""The step trace's file format: records, run headers, the writer and the reader (see :mod:`lightning_repro.trace`)."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_repro.exceptions import InputError

__all__ = [
    "TRACE_VERSION",
    "Trace",
    "TraceRecord",
    "TraceRun",
    "TraceWriter",
    "decode_loss",
    "encode_loss",
    "history",
    "read_trace",
    "read_trace_file",
    "trace_file_name",
]

TRACE_VERSION = 1
"""The version of the trace format, in each run header."""

# field compared -> cause, in the order of precedence: the first field that differs at a step names the cause
_OPTIONAL = ("indices", "data", "loss", "streams", "params")


@dataclass(frozen=True)
class TraceRecord:
    """One optimizer step of one rank.

    Attributes:
        step: The global step after the optimizer step (the first step is 1).
        epoch: The epoch of the step.
        batch: The batch index in the epoch of the step's last batch.
        rank: The global rank that wrote it.
        indices: Digest of the sample indices of the step's batches (None: a loader we do not take over).
        data: Digest of the batch contents.
        loss: The loss's exact bits (see :func:`encode_loss`), one per batch of the step, or None.
        streams: Digest of the process-stream states at the start of the step.
        params: Digest of the parameters after the step, or None between ``trace_params_every`` intervals.
    """

    step: int
    epoch: int
    batch: int
    rank: int = 0
    indices: str | None = None
    data: str | None = None
    loss: str | None = None
    streams: str | None = None
    params: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as a dict of plain values (a JSON line, an entry's trace tail), in field order."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "batch": self.batch,
            "rank": self.rank,
            "indices": self.indices,
            "data": self.data,
            "loss": self.loss,
            "streams": self.streams,
            "params": self.params,
        }  # not dataclasses.asdict: it deep-copies each field (about 10 us a record, once per step)

    @classmethod
    def from_dict(cls, value: Any) -> TraceRecord:
        """Check a record read from a file or an entry; unknown keys are ignored.

        Raises:
            ValueError: a key is missing or of the wrong type (the message names it).

        Examples:
            >>> TraceRecord.from_dict({"step": 3, "epoch": 0, "batch": 2, "loss": "3ff0000000000000"}).loss
            '3ff0000000000000'
        """
        if not isinstance(value, dict):
            raise ValueError(f"a record must be a JSON object, got {type(value).__name__}")
        ints = {}
        for key in ("step", "epoch", "batch", "rank"):
            item = value.get(key, 0 if key == "rank" else None)
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise ValueError(f"{key!r} must be a non-negative int, got {item!r}")
            ints[key] = item
        texts = {}
        for key in _OPTIONAL:
            item = value.get(key)
            if item is not None and not isinstance(item, str):
                raise ValueError(f"{key!r} must be a string or null, got {item!r}")
            texts[key] = item
        return cls(
            step=ints["step"],
            epoch=ints["epoch"],
            batch=ints["batch"],
            rank=ints["rank"],
            indices=texts["indices"],
            data=texts["data"],
            loss=texts["loss"],
            streams=texts["streams"],
            params=texts["params"],
        )


@dataclass(frozen=True)
class TraceRun:
    """One run's part of a trace file: its header (``{}`` before the first header) and its records."""

    header: dict[str, Any]
    records: tuple[TraceRecord, ...]

    @property
    def resumed_from_step(self) -> int | None:
        """The global step of the checkpoint this run resumed from, or None for a run from scratch."""
        value = self.header.get("resumed_from_step")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Trace:
    """One rank's trace: the history of its steps and the runs of the file.

    Attributes:
        path: The file it was read from.
        rank: The rank that wrote it.
        records: The history, one record per step in step order: each run's records replace the earlier runs'
            records of the steps after its resume point.
        runs: Every run of the file, in file order, with all its records (the superseded ones too).
        notes: What the reader noticed and put aside (a torn last line).
    """

    path: str
    rank: int
    records: tuple[TraceRecord, ...]
    runs: tuple[TraceRun, ...] = ()
    notes: tuple[str, ...] = ()

    def by_step(self) -> dict[int, TraceRecord]:
        """The records of :attr:`records` by step."""
        return {record.step: record for record in self.records}


def history(runs: Iterable[TraceRun]) -> tuple[TraceRecord, ...]:
    """One record per step from a file's runs: a run replaces earlier records of the steps after its resume point.

    Examples:
        >>> r = lambda step, loss: TraceRecord(step, 0, step - 1, loss=loss)
        >>> first = TraceRun({}, (r(1, "a"), r(2, "b"), r(3, "c")))
        >>> resumed = TraceRun({"resumed_from_step": 1}, (r(2, "B"),))
        >>> [x.loss for x in history([first, resumed])]
        ['a', 'B']
    """
    steps: dict[int, TraceRecord] = {}
    for run in runs:
        start = run.resumed_from_step or 0
        steps = {step: record for step, record in steps.items() if step <= start}
        for record in run.records:
            steps[record.step] = record
    return tuple(steps[step] for step in sorted(steps))


# ---------------------------------------------------------------------------------------------- loss bits
def encode_loss(value: float) -> str:
    """The exact bits of a loss: 16 hex digits of its IEEE-754 binary64 encoding, big-endian.

    float16, bfloat16 and float32 losses widen to binary64 exactly, so the bits of every float loss are kept.

    Examples:
        >>> encode_loss(1.0), decode_loss(encode_loss(0.1)) == 0.1
        ('3ff0000000000000', True)
    """
    return struct.pack(">d", value).hex()


def decode_loss(bits: str | None) -> float | None:
    """The float of :func:`encode_loss` (the last one when a step has several batches); for plotting only."""
    if not bits:
        return None
    try:
        return float(struct.unpack(">d", bytes.fromhex(bits.split(",")[-1]))[0])
    except (ValueError, struct.error):
        return None


# ---------------------------------------------------------------------------------------------- writing
def trace_file_name(path: str | os.PathLike[str], rank: int, world_size: int) -> Path:
    """The file rank ``rank`` writes for ``trace=path``.

    A directory (an existing one, or a path without the ``.jsonl`` suffix) holds ``trace-rank{r}.jsonl``; a file
    path is rank 0's file, and rank ``r > 0`` writes ``{stem}-rank{r}.jsonl`` beside it.

    Examples:
        >>> trace_file_name("runs/trace.jsonl", 1, 2).as_posix(), trace_file_name("runs", 0, 1).as_posix()
        ('runs/trace-rank1.jsonl', 'runs/trace-rank0.jsonl')
    """
    target = Path(path)
    if target.is_dir() or target.suffix != ".jsonl":
        return target / f"trace-rank{rank}.jsonl"
    if rank == 0:
        return target
    return target.with_name(f"{target.stem}-rank{rank}.jsonl")


class TraceWriter:
    """Appends a run header and then one JSON line per record to a trace file, each line written at once.

    A torn last line left by a killed process is cut off when the file is opened, so the new lines start clean.
    Each line is one ``os.write`` of its UTF-8 bytes to the file opened for appending: in the file when the call
    returns (a killed process loses no record it wrote), without a buffer to flush (the text layer's write and
    flush cost some 40 us right after a training step, cold caches).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cut = _cut_torn_line(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def header(self, **values: Any) -> None:
        """Write the header of a run: ``{"run": {"version": TRACE_VERSION, **values}}``."""
        self._line(_json_line({"run": {"version": TRACE_VERSION, **values}}))

    def write(self, record: TraceRecord) -> None:
        """Append one record."""
        self._line(record_line(record) or _json_line(record.to_dict()))

    def _line(self, line: str) -> None:
        if self._fd is None:
            raise ValueError(f"the trace file {str(self.path)!r} is closed")
        data = line.encode()
        while data:
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        """Close the file (further writes raise)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_HEX = "0123456789abcdef,"


def _json_line(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":")) + "\n"


def _text(value: Any) -> str | None:
    """``value`` as JSON, for an int, None or a string of hex digits and commas (what a record holds); else None."""
    if value is None:
        return "null"
    if type(value) is int:
        return str(value)
    if type(value) is str and not value.strip(_HEX):
        return f'"{value}"'  # nothing in it to escape
    return None


def record_line(record: TraceRecord) -> str | None:
    """The JSON line of a record as ``json.dumps(record.to_dict(), separators=(",", ":"))`` writes it, or None.

    Formatted without ``json``, whose encoder costs some 40 us right after a training step (cold caches); None when
    a field holds anything but an int, None or hex digits and commas: ``json`` writes that record.
    """
    fields = record.to_dict()
    texts = [_text(value) for value in fields.values()]
    if None in texts:
        return None
    return "{" + ",".join(f'"{key}":{text}' for key, text in zip(fields, texts, strict=True)) + "}\n"


def _cut_torn_line(path: Path) -> int:
    """Truncate ``path`` after its last newline; the number of bytes cut (0: nothing torn, or no file)."""
    if not path.exists():
        return 0
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(max(0, size - 65536))
        tail = f.read()
        if tail.endswith(b"\n"):
            return 0
        keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        f.truncate(keep)
        return size - keep


# ---------------------------------------------------------------------------------------------- reading
def read_trace_file(path: str | os.PathLike[str]) -> Trace:
    """Read one trace file.

    Raises:
        InputError: the file is missing or unreadable, or a line (other than a torn last one) is not a header or
            a record; the one-line message names the file and the line.
    """
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{name}: no such trace file") from None
    except OSError as error:
        raise InputError(f"{name}: cannot read it ({type(error).__name__}: {error.strerror or error})") from None
    lines = raw.split(b"\n")
    torn = lines.pop()  # the part after the last newline: empty unless the writer was killed mid-line
    notes = []
    if torn.strip():
        notes.append(f"{name}: ignored a torn last line {len(lines) + 1} ({len(torn)} bytes; the writer was killed)")
    runs: list[tuple[dict[str, Any], list[TraceRecord]]] = []
    rank: int | None = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line.decode("utf-8"))
            if isinstance(value, dict) and "run" in value:
                header = value["run"]
                if not isinstance(header, dict):
                    raise ValueError("a run header must hold a JSON object")
                runs.append((header, []))
                continue
            record = TraceRecord.from_dict(value)
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            raise InputError(f"{name}, line {number}: not a trace record or run header ({_one_line(error)})") from None
        if not runs:
            runs.append(({}, []))
        runs[-1][1].append(record)
        rank = record.rank if rank is None else rank
    if rank is None:
        header_rank = next((h.get("rank") for h, _ in runs if isinstance(h.get("rank"), int)), None)
        rank = header_rank if isinstance(header_rank, int) and header_rank >= 0 else _rank_of_name(Path(path))
    parts = tuple(TraceRun(header, tuple(records)) for header, records in runs)
    return Trace(path=name, rank=rank, records=history(parts), runs=parts, notes=tuple(notes))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


_RANK_FILE = re.compile(r"-rank(\d+)\.jsonl$")


def _rank_of_name(path: Path) -> int:
    match = _RANK_FILE.search(path.name)
    return int(match.group(1)) if match else 0


def read_trace(path: str | os.PathLike[str]) -> dict[int, Trace]:
    """Read a trace file, or a directory holding one ``*-rank{r}.jsonl`` file per rank: the traces by rank.

    Raises:
        InputError: the path is missing, a directory without trace files, two files of one rank, or a file is
            malformed (see :func:`read_trace_file`).
    """
    target = Path(path)
    if target.is_dir():
        files = sorted(target.glob("*-rank*.jsonl")) or sorted(target.glob("*.jsonl"))
        if not files:
            raise InputError(f"{target}: a directory without trace files (trace-rank<R>.jsonl)")
    elif target.exists():
        files = [target]
    else:
        raise InputError(f"{target}: no such trace file or directory")
    traces: dict[int, Trace] = {}
    for file in files:
        trace = read_trace_file(file)
        if trace.rank in traces:
            raise InputError(f"{target}: two trace files of rank {trace.rank} ({traces[trace.rank].path}, {file})")
        traces[trace.rank] = trace
    return dict(sorted(traces.items()))
