"""Training functions for tests/test_stats.py, run by name in the seeds' fresh processes (pure Python: fast)."""

from __future__ import annotations

import os
import time

NOT_A_FUNCTION = 3


def metrics(seed: int) -> dict[str, float]:
    return {"a": float(seed), "b": 1.0 / (seed + 1)}


def flaky(seed: int) -> dict[str, float]:
    """Seed 0 works; 1 raises; 2 dies (exit code 7) after printing; 3 hangs."""
    if seed == 1:
        raise ValueError(f"boom at seed {seed}")
    if seed == 2:
        print("about to die", flush=True)
        os._exit(7)
    if seed == 3:
        time.sleep(120)
    return {"a": 1.0}


def missing_metric(seed: int) -> dict[str, float]:
    return {"a": 1.0, "b": 2.0} if seed == 0 else {"b": 2.0}


def not_a_dict(seed: int) -> float:
    return 1.0


def not_a_number(seed: int) -> dict[str, object]:
    return {"a": "high"}


def numeric_text(seed: int) -> dict[str, object]:
    return {"a": "0.5"}  # text float() reads as a number: still not a number


def huge(seed: int) -> dict[str, object]:
    return {"a": 10**400}  # past float's range: float() raises OverflowError


def extra_metric(seed: int) -> dict[str, float]:
    return {"a": 1.0} if seed == 0 else {"a": 2.0, "late": 3.0}


def nan_on_one(seed: int) -> dict[str, float]:
    print(f"training seed {seed}", flush=True)
    return {"loss": float("nan") if seed == 1 else 0.5 + seed, "acc": 0.9}
