"""A sharded checkpoint written before the first optimizer step resumes exactly and is verified as such.

Lightning's ``ModelParallelStrategy`` saves the optimizers through ``get_optimizer_state_dict``, which first fills an
empty optimizer state (torch's zero-gradient step at learning rate 0), after our callback has digested it: the
restore check then warned that the optimizer differs from what it saved, and the resume line said "exact (restore
check failed ...)". Each layout: the fit that saved it in ``on_train_start`` (continued to the end) against the
resumed fit, in fresh processes (``tests/sharded_prestep.py``: one rank, gloo).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sharded, pytest.mark.slow]
SCRIPT = Path(__file__).with_name("sharded_prestep.py")


def _fit(*args: str) -> tuple[dict[str, str], str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("layout", ["distributed", "file"])
def test_a_checkpoint_before_the_first_optimizer_step_resumes_verified(layout: str, tmp_path: Path) -> None:
    ckpt = str(tmp_path / ("prestep" if layout == "distributed" else "prestep.ckpt"))
    uninterrupted, _ = _fit(layout, ckpt)
    resumed, stderr = _fit(layout, ckpt, "--resume")
    assert resumed == uninterrupted  # bitwise: parameters and AdamW state of the local shards
    assert "differs from the state it saved" not in stderr
    assert ": exact (restore verified: parameters, optimizer, lr_schedulers" in stderr, stderr[-3000:]
