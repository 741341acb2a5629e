"""Write a benchmark's markdown table into the documentation, between its markers.

A page holds each generated table between two HTML comments, invisible on the rendered site::

    <!-- bench_overhead:start -->
    | workload | ... |
    <!-- bench_overhead:end -->

``python benchmarks/NAME.py --write-docs`` measures, prints its table as always, and replaces what lies between
``NAME``'s markers in its page (``PAGES``) with it; the text around the markers is left as it is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {
    "bench_overhead": ROOT / "docs" / "performance.md",
    "bench_sharded": ROOT / "docs" / "performance.md",
    "bench_streaming": ROOT / "docs" / "performance.md",
    "bench_ddp": ROOT / "docs" / "performance.md",
    "bench_trace": ROOT / "docs" / "performance.md",
    "plain_matrix": ROOT / "docs" / "resume.md",
}
"""The page that holds each benchmark's table, by marker name (the script's name)."""


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of the table ``name``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_table(text: str, name: str, table: str) -> str:
    """``text`` with what lies between the markers of ``name`` replaced by ``table``.

    Raises ``ValueError`` when the markers are missing, repeated or out of order.
    """
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(
            f"expected the markers {start!r} and {end!r} once each, found {text.count(start)} and {text.count(end)}:"
            " put them around the table in the page"
        )
    head, rest = text.split(start)
    if end not in rest:
        raise ValueError(f"{end!r} comes before {start!r}: put the end marker after the table")
    _, tail = rest.split(end)
    return f"{head}{start}\n{table.strip()}\n{end}{tail}"


def write_table(name: str, table: str, page: Path | None = None) -> Path:
    """Rewrite the table ``name`` in ``page`` (default: its page in ``PAGES``); return the page's path."""
    path = page if page is not None else PAGES[name]
    text = path.read_text(encoding="utf-8")
    path.write_text(replace_table(text, name, table), encoding="utf-8")
    return path


def add_flag(parser: argparse.ArgumentParser, name: str) -> None:
    """Add ``--write-docs`` to a benchmark's parser."""
    page = PAGES[name].relative_to(ROOT)
    parser.add_argument(
        "--write-docs", action="store_true", help=f"also rewrite the table in {page} (between its {name} markers)"
    )
