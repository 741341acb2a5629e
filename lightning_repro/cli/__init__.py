"""The ``lightning-repro`` command line: one module per verb, each only parsing, calling and printing.

Owns the entry point and the exit codes (``main``), ``diff`` (``trace``), ``doctor`` (``doctor``: the environment
audit; ``replay``: the replay of one step), ``env`` (``env``), ``inspect`` (``inspect``) and ``seeds`` (``seeds``).
The work is done by the folders below (``trace``, ``manifest``, ``stats``, ``checkpoint``); the CLI may import
anything, nothing imports it.
"""

from __future__ import annotations

from lightning_repro.cli.main import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_DIFFERENT, EXIT_OK, build_parser, main

__all__ = ["EXIT_BAD_INPUT", "EXIT_BROKEN_PIPE", "EXIT_DIFFERENT", "EXIT_OK", "build_parser", "main"]
