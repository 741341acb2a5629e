"""``lightning-repro env [--json] [--compare FILE]``: this environment's manifest, or its drift from a saved one."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from lightning_repro.manifest.collect import collect_manifest

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["env_command"]


def env_command(args: argparse.Namespace, console: Console) -> int:
    """``lightning-repro env [--json] [--compare FILE]``: this manifest, or its drift from a saved one (exit code)."""
    from lightning_repro.manifest import drift

    current = collect_manifest()
    if args.compare:
        return drift.compare_command(args.compare, current, console, as_json=bool(args.json))
    if args.json:
        console.out(json.dumps(current, indent=2, sort_keys=True), highlight=False)
        return 0
    drift.print_manifest(current, console)
    return 0

