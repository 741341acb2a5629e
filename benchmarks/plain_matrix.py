"""Which cells of the ordinary-project resume matrix plain Lightning gets wrong (documentation, not a test).

Runs every case of ``tests/test_ordinary_project.py`` (``CASES``) with plain Lightning (``seed_everything(workers=
True)``, ``deterministic=True``) instead of ``DeterminismCallback``: the uninterrupted run, the kill, the resume,
and prints for each cell what differs from the uninterrupted run (the fields of ``ordinary_project.compare``).
The table of what plain Lightning gets wrong in ``docs/resume.md`` is this script's output (about 30 s on 2 cores);
``--write-docs`` writes it there (between its ``plain_matrix`` markers)::

    .venv/bin/python benchmarks/plain_matrix.py [--write-docs]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]

import ordinary_project as project  # noqa: E402
import runner  # noqa: E402
import test_ordinary_project as matrix  # noqa: E402
from docs_tables import add_flag, write_table  # noqa: E402


def cell(runs: matrix.Runs, name: str, cfg: dict, kill: dict) -> tuple[str, list[str]]:
    plain = {**cfg, "repro": False}
    reference, reference_record = runs.reference(plain)
    resumed, record, out = runs.kill_and_resume(plain, kill)
    problems = project.compare(reference, reference_record, resumed, out / "record-killed.jsonl", record)
    return name, [p.split(":", 1)[0].split(" after")[0] for p in problems]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flag(parser, "plain_matrix")
    args = parser.parse_args(argv)
    runner.start_fork_server()
    with tempfile.TemporaryDirectory() as tmp:
        runs = matrix.Runs(Path(tmp))
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(cell, runs, name, cfg, kill) for name, cfg, kill in matrix.CASES]
            results = [f.result() for f in futures]
    lines = ["| cell | plain Lightning differs from its uninterrupted run in |", "|---|---|"]
    lines += [f"| {name} | {', '.join(fields) if fields else 'nothing'} |" for name, fields in results]
    table = "\n".join(lines)
    print(table)
    if args.write_docs:
        print(f"\nwritten into {write_table('plain_matrix', table)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
