"""The run manifest: what a run was a function of (code, data, environment, seeds, hardware), and its drift.

Owns collecting the manifest (``collect``: :func:`collect_manifest`), the file written beside a run (``files``:
where it goes, written and published), the callback's glue (``run``: start at setup, publish, check a resumed
entry), drift between two manifests and its three classes (``drift``), the environment fingerprint stored in every
rank's part (``fingerprint``), the code's state from git or the package's files (``codestate``) and hashed data paths
with their cache (``datahash``).

May import the bottom layer only (``exceptions``, ``seeding``, ``_warn``); ``checkpoint`` imports ``fingerprint``
from here.
The ``lightning-repro env`` verb that prints it lives in :mod:`lightning_repro.cli.env`.
"""

from __future__ import annotations

from lightning_repro.manifest.collect import (
    IMAGE_DIGEST_ENV,
    MANIFEST_FILE,
    MANIFEST_VERSION,
    collect_manifest,
    manifest_hparams,
    start_manifest,
    validate_options,
)
from lightning_repro.manifest.files import checkpoint_dirs, manifest_dir, publish_manifest, write_manifest

__all__ = [
    "IMAGE_DIGEST_ENV",
    "MANIFEST_FILE",
    "MANIFEST_VERSION",
    "checkpoint_dirs",
    "collect_manifest",
    "manifest_dir",
    "manifest_hparams",
    "publish_manifest",
    "start_manifest",
    "validate_options",
    "write_manifest",
]
