"""The ``lightning-repro`` command line (also ``python -m lightning_repro``).

Verbs::

    lightning-repro diff A B [--json] [--plot FILE.png]   where two step traces part, and why   (exit 0 / 1 / 2)
    lightning-repro doctor [TARGET]                       what decides reproducibility here     (exit 0 / 1 / 2)
    lightning-repro env [--json] [--compare FILE]         the run manifest, or its drift        (exit 0 / 1 / 2)
    lightning-repro inspect CKPT [--json]                 what a checkpoint's entry holds       (exit 0 / 1 / 2)
    lightning-repro seeds TARGET --seeds K                a training function over K seeds      (exit 0 / 1 / 2)

Exit codes: 0 all agree / nothing wrong, 1 a difference that matters was found, 2 bad input (a missing or
malformed file, a bad argument): one line on stderr, no traceback. When the reader of the output goes away
(``lightning-repro env | head``) the verb stops quietly with 141, the status a shell gives a command that SIGPIPE
ended: not 1, which would read as a difference found.

Each verb's work is done by a function of its module (``trace``, ``doctor``, ``env``, ``inspect``, ``seeds``) with the
signature ``(args: argparse.Namespace, console: rich.console.Console) -> int``; this module only parses arguments,
dispatches, and turns :class:`~lightning_repro.InputError` into exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning_repro.exceptions import InputError

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["EXIT_BAD_INPUT", "EXIT_BROKEN_PIPE", "EXIT_DIFFERENT", "EXIT_OK", "build_parser", "main"]

EXIT_OK = 0
"""Everything compared agrees (or nothing wrong was found)."""
EXIT_DIFFERENT = 1
"""A difference that matters was found (divergent traces, drift that breaks bitwise continuation...)."""
EXIT_BAD_INPUT = 2
"""Bad input: a missing or malformed file, a bad argument."""
EXIT_BROKEN_PIPE = 141
"""The reader of the output went away before it was all written (128 + SIGPIPE, as a shell reports it)."""

# verb -> "module:function" doing the work, imported only when the verb runs (the CLI starts fast)
_HANDLERS = {
    "diff": "lightning_repro.cli.trace:diff_command",
    "doctor": "lightning_repro.cli.doctor:doctor_command",
    "env": "lightning_repro.cli.env:env_command",
    "inspect": "lightning_repro.cli.inspect:inspect_command",
    "seeds": "lightning_repro.cli.seeds:seeds_command",
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit code 2 (argparse's own code for usage errors)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every verb."""
    parser = _Parser(prog="lightning-repro", description="Check and explain the reproducibility of Lightning runs.")
    verbs = parser.add_subparsers(
        dest="verb", required=True, metavar="{diff,doctor,env,inspect,seeds}", parser_class=_Parser
    )

    diff = verbs.add_parser("diff", help="the first step where two step traces differ, the field and the cause")
    diff.add_argument("a", metavar="A", help="a trace file, or a directory holding trace files")
    diff.add_argument("b", metavar="B", help="a trace file, or a directory holding trace files")
    diff.add_argument("--json", action="store_true", help="print the report as one JSON object")
    diff.add_argument("--plot", metavar="FILE.png", help="draw both loss curves and mark the divergence (matplotlib)")

    doctor = verbs.add_parser("doctor", help="audit what decides reproducibility here, and optionally a model")
    doctor.add_argument(
        "target",
        metavar="TARGET",
        nargs="?",
        help="module:function (or path/to/file.py:function) returning (LightningModule, batch): replays one"
        " training step and names the modules whose outputs or gradients differ",
    )
    doctor.add_argument("--json", action="store_true", help="print the audit as JSON")

    env = verbs.add_parser("env", help="the run manifest of this environment, or its drift from a saved one")
    env.add_argument("--json", action="store_true", help="print the manifest (or the drift) as JSON")
    env.add_argument("--compare", metavar="FILE", help="a manifest JSON or a checkpoint to compare with")

    inspect = verbs.add_parser("inspect", help="what a checkpoint's lightning-repro entry holds, and if it is whole")
    inspect.add_argument("checkpoint", metavar="CKPT", help="a checkpoint file, or a distributed checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    seeds = verbs.add_parser("seeds", help="run a training function over several seeds: mean, std, 95%% interval")
    seeds.add_argument(
        "target",
        metavar="TARGET",
        help="module:function (or path/to/file.py:function) taking a seed, returning {metric: value}",
    )
    seeds.add_argument("--seeds", type=int, default=5, metavar="K", help="how many seeds (default 5)")
    seeds.add_argument("--first-seed", type=int, default=0, metavar="S", help="the seeds are S, S+1, ... (default 0)")
    seeds.add_argument("--metrics", nargs="+", metavar="NAME", help="the metrics to report (default: all returned)")
    seeds.add_argument("--out", metavar="FILE.json", help="write the report here")
    seeds.add_argument("--json", action="store_true", help="print the report as JSON")
    seeds.add_argument(
        "--confidence", type=float, default=0.95, metavar="C", help="level of the intervals (default 0.95)"
    )
    seeds.add_argument(
        "--check",
        metavar="REPORT.json",
        help="a saved report: exit 1 when a new seed's value falls outside its prediction band",
    )
    seeds.add_argument(
        "--start-method",
        choices=["spawn", "forkserver"],
        default="spawn",
        help="how each seed's fresh process starts (forkserver: imports once, forks per seed; default spawn)",
    )
    seeds.add_argument("--timeout", type=float, metavar="S", help="kill a seed's process after S seconds")
    seeds.add_argument(
        "--log-dir", metavar="DIR", help="keep each seed's output in DIR/seed-N.log (default: a temporary folder)"
    )
    return parser


OFF_TERMINAL_WIDTH = 160
"""The width of the tables written to a pipe or a file (rich's 80 columns cut the digests of ``diff``'s table)."""


def _console() -> Console:
    from rich.console import Console

    class _CliConsole(Console):
        def on_broken_pipe(self) -> None:  # rich's own exits 1: "a difference found" here
            _stop_writing()

    console = _CliConsole(soft_wrap=True)
    if not console.is_terminal:  # a log file: as wide as every table needs (a terminal keeps its own width)
        console.width = max(console.width, OFF_TERMINAL_WIDTH)
    return console


def _stop_writing() -> None:
    """The reader went away: later writes (and the interpreter's last flush) go nowhere; exit 141."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    raise SystemExit(EXIT_BROKEN_PIPE)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; return its exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    module_name, function_name = _HANDLERS[args.verb].split(":")
    handler = getattr(importlib.import_module(module_name), function_name)
    try:
        code = int(handler(args, _console()))
        sys.stdout.flush()  # a reader gone shows here, not in the interpreter's last flush (which would exit 120)
        return code
    except InputError as error:
        print(f"lightning-repro {args.verb}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        _stop_writing()
        raise  # pragma: no cover - _stop_writing raises SystemExit


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
