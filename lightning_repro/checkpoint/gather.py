"""The wire of the entry's gather: a rank's part, its tensors out of band, and its encoding, in one ``all_gather``.

A rank's part is a few small tensors (the process streams, metric states, logged values) and plain values. Pickled as
torch pickles a tensor (a ``torch.save`` into memory per storage, a ``torch.load`` per storage on the other side) it
costs about a millisecond a part; here a plain CPU tensor travels as its dtype, shape and raw bytes beside the
pickle, and is rebuilt from them: the same dtype, shape and bytes, hence the same value in the file and the same
digests. Any other tensor (on a GPU, a subclass, a view into a larger storage, one that requires grad) is pickled as
torch pickles it. The part's encoding (:mod:`~lightning_repro.checkpoint.encoding`) travels with it, so the ranks
seal the entry without encoding the others' parts.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import torch

__all__ = ["all_gather_bytes", "gather_parts", "pack_part", "unpack_part"]

_GATHER_BYTES = 1 << 16
"""A rank's packed part up to this size travels in the first and only round of :func:`gather_parts`."""
_GATHER_TOTAL = 1 << 20
"""... as long as the first round moves at most this much to each rank (else it carries the sizes only)."""

_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}
"""The dtypes of the tensors that travel as raw bytes, by name."""


def _out_of_band(value: Any) -> bool:
    """A plain CPU tensor that is all of its storage: its dtype, shape and bytes are all there is to it."""
    return (
        type(value) is torch.Tensor
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and not (value.requires_grad or value.is_nested or value.is_quantized or value.is_conj() or value.is_neg())
        and str(value.dtype).removeprefix("torch.") in _DTYPES
        and all(name is None for name in getattr(value, "names", ()))
        and value.is_contiguous()
        and value.storage_offset() == 0
        and value.untyped_storage().nbytes() == value.numel() * value.element_size()
    )


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.index: dict[int, int] = {}  # a tensor met twice travels once (and is one tensor again after)

    def persistent_id(self, obj: Any) -> Any:
        if not _out_of_band(obj):
            return None
        if id(obj) not in self.index:
            self.index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return ("tensor", self.index[id(obj)])


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid[1]]


def _raw(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), data


def _tensor(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=_DTYPES[dtype])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(_DTYPES[dtype]).reshape(shape)


def pack_part(part: dict[str, Any], code: bytes) -> bytes:
    """A rank's part (``RankPart.to_dict()``) and its encoding as bytes, for :func:`unpack_part` on another rank."""
    buffer = io.BytesIO()
    tensors: list[torch.Tensor] = []
    _Pickler(buffer, tensors).dump(part)
    return pickle.dumps((buffer.getvalue(), [_raw(t) for t in tensors], code), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_part(payload: bytes) -> tuple[dict[str, Any], bytes]:
    """The part and the encoding :func:`pack_part` packed."""
    pickled, raw, code = pickle.loads(payload)
    part: dict[str, Any] = _Unpickler(io.BytesIO(pickled), [_tensor(*r) for r in raw]).load()
    return part, code


def gather_parts(part: dict[str, Any], code: bytes) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Every rank's part and encoding, in rank order (a collective: call it on every rank); this rank's as given."""
    import torch.distributed as dist

    rank = dist.get_rank()
    parts, codes = [], []
    for index, payload in enumerate(all_gather_bytes(pack_part(part, code))):
        theirs, their_code = (part, code) if index == rank else unpack_part(payload)
        parts.append(theirs)
        codes.append(their_code)
    return parts, codes


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Every rank's ``payload``, in rank order: its size and, when every one fits, the payload in the same round.

    A collective: call it on every rank.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = dist.get_world_size()
    device = distributed_c10d._get_object_coll_device()  # the CPU for gloo, this rank's GPU for NCCL
    capacity = min(_GATHER_BYTES, _GATHER_TOTAL // world)
    first = bytearray(struct.pack("<q", len(payload))) + bytearray(capacity)
    if len(payload) <= capacity:
        first[8 : 8 + len(payload)] = payload
    got = _all_gather_buffer(first, device, world)
    sizes = [struct.unpack("<q", raw[:8])[0] for raw in got]
    if max(sizes) <= capacity:
        return [raw[8 : 8 + size] for raw, size in zip(got, sizes, strict=True)]
    padded = bytearray(payload) + bytearray(max(sizes) - len(payload))  # a part too large: a second round
    return [raw[:size] for raw, size in zip(_all_gather_buffer(padded, device, world), sizes, strict=True)]


def _all_gather_buffer(buffer: bytearray, device: str, world: int) -> list[bytes]:
    import torch.distributed as dist

    sent = torch.frombuffer(buffer, dtype=torch.uint8).to(device)
    received = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(received, sent)
    return [t.cpu().numpy().tobytes() for t in received]
