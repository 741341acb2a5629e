"""The step trace's fast paths write what the general ones do: a tensor's digest, a record's JSON line.

A trace is compared with traces other versions and machines wrote, so the few-calls paths taken for speed
(``digest._raw_bytes``, ``records.record_line``) must give the general paths' bytes exactly, for every kind of value.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_repro.trace import TraceRecord, TraceWriter, read_trace_file
from lightning_repro.trace import digest as _digest
from lightning_repro.trace.records import record_line


def _general(value: torch.Tensor) -> bytes:
    """What a CPU tensor contributes to a digest, through the general path (every tensor through ``view(uint8)``)."""
    t = value.detach().contiguous().reshape(-1)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    raw = t.view(torch.uint8).numpy()
    return struct.pack("<I", zlib.crc32(raw.data)) if raw.nbytes >= _digest._CRC_BYTES else raw.tobytes()


def _fast(value: torch.Tensor) -> bytes:
    raw = _digest._raw_bytes(value)
    return struct.pack("<I", zlib.crc32(raw)) if raw.nbytes >= _digest._CRC_BYTES else raw.tobytes()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    image = torch.randn(32, 3, 32, 32, generator=g)  # a batch: over the CRC threshold
    small = torch.randn(5, 7, generator=g)
    return {
        "batch": image,
        "transposed": small.t(),
        "sliced": image[3:9, :, 4:20],  # not contiguous, with a storage offset
        "offset": small[2:],  # contiguous, with a storage offset
        "expanded": torch.ones(3, 1).expand(3, 4),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "int64": torch.arange(40_000),
        "bool": torch.rand(9, generator=g) > 0.5,
        "bfloat16": torch.randn(8, 3, generator=g).to(torch.bfloat16),
        "float16": torch.randn(8, 3, generator=g).half(),
        "complex": torch.randn(4, 3, dtype=torch.complex64, generator=g),
        "complex-transposed": torch.randn(4, 3, dtype=torch.complex128, generator=g).t(),
        "grad": torch.randn(6, requires_grad=True, generator=g),
        "neg-bit": torch.randn(4, 3, dtype=torch.complex64, generator=g).conj().imag,
        "uint8": torch.randint(0, 255, (70_000,), dtype=torch.uint8, generator=g),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_a_tensor_s_fast_bytes_are_the_general_path_s(name: str) -> None:
    value = _tensors()[name]
    assert _fast(value) == _general(value)


def test_the_digest_of_a_batch_is_that_of_the_general_path() -> None:
    """The whole digest of a structure (a batch of images and labels, a state dict) through ``Digest.add``."""
    tensors = _tensors()
    d = _digest.Digest()
    d.add((tensors["batch"], tensors["int64"], {"w": tensors["transposed"], "b": tensors["bfloat16"]}))
    expected = _digest.hashlib.sha256()
    for value, prefix in (
        (None, b"L3"),
        (tensors["batch"], None),
        (tensors["int64"], None),
        (None, b"D2"),
        ("b", None),
        (tensors["bfloat16"], None),
        ("w", None),
        (tensors["transposed"], None),
    ):
        if prefix is not None:
            expected.update(prefix)
        elif isinstance(value, str):
            expected.update(f"V{value!r}".encode())
        else:
            assert isinstance(value, torch.Tensor)
            expected.update(f"T{value.dtype}{tuple(value.shape)}".encode())
            expected.update(_general(value))
    assert d.hexdigest([]) == expected.hexdigest()[: _digest.DIGEST_HEX]


_hex = st.text(alphabet="0123456789abcdef,", max_size=40)
_any_text = st.text(max_size=12)  # quotes, backslashes, control characters, non-ASCII: the json fallback
_field = st.one_of(st.none(), _hex, _any_text)


@given(
    step=st.integers(0, 2**40),
    epoch=st.one_of(st.integers(0, 10**6), st.booleans()),
    batch=st.integers(-1, 10**6),
    indices=_field,
    data=_field,
    loss=_field,
    streams=_field,
    params=_field,
)
def test_a_record_s_line_is_what_json_writes(
    step: int, epoch: int, batch: int, indices: str, data: str, loss: str, streams: str, params: str
) -> None:
    record = TraceRecord(
        step=step, epoch=epoch, batch=batch, rank=0, indices=indices, data=data, loss=loss, streams=streams,
        params=params,
    )  # fmt: skip
    plain = [v is None or type(v) is int or (type(v) is str and not v.strip("0123456789abcdef,"))
             for v in record.to_dict().values()]  # fmt: skip
    expected = json.dumps(record.to_dict(), separators=(",", ":")) + "\n"
    # the fast path writes every record the tracer makes (ints, None, hex digits), and leaves the others to json
    assert record_line(record) == (expected if all(plain) else None)


def test_the_writer_writes_json_s_lines_for_odd_records_too(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path)
    writer.header(rank=0, world_size=1, resumed_from_step=None, params_every=10)
    records = [
        TraceRecord(step=1, epoch=0, batch=0, rank=0, indices="ab" * 16, data="cd" * 16, loss="3ff0000000000000",
                    streams="ef" * 16, params=None),
        TraceRecord(step=2, epoch=0, batch=1, rank=0, indices=None, data='quote" and \\ back', loss=None,
                    streams="é", params="12"),
    ]  # fmt: skip
    for record in records:
        writer.write(record)
    writer.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[1:] == [json.dumps(r.to_dict(), separators=(",", ":")) for r in records]
    assert list(read_trace_file(path).records) == records
