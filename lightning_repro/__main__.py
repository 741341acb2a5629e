"""``python -m lightning_repro``: the ``lightning-repro`` command line."""

from __future__ import annotations

import sys

from lightning_repro.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
