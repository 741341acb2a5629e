"""The row checksums of ``hashing.row_checksums`` in one pass over memory (``_rowsums.c``)."""

def checksums(src: object, out: object, kernel: int = -1, /) -> None:
    """Write the checksum of each 4 KiB row of the buffer ``src`` (any alignment) into ``out`` (an int64 a row)."""

def kernels() -> list[str]:
    """The kernels this CPU runs (``"scalar"``, ``"avx2"``, ``"avx512"``), the one :func:`checksums` uses last."""

def crc32(src: object, value: int = 0, /) -> tuple[int, int]:
    """``zlib.crc32`` of the first ``used`` bytes of ``src`` from ``value``: ``(crc, used)`` (``used`` 0: none done)."""
