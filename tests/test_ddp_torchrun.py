"""DDP launched by ``torchrun --nproc_per_node=2``: a killed job (with BatchNorm) resumes bitwise."""

from __future__ import annotations

from typing import Any

import pytest
from ddp_cases import killed_job_resumes_bitwise

pytestmark = [pytest.mark.ddp, pytest.mark.slow, pytest.mark.launchers]  # in the marked run of scripts/test.sh


def test_killed_job_resumes_bitwise(runs: Any) -> None:
    """With BatchNorm: each rank's running statistics differ after its forward, the file holds rank 0's, and DDP
    broadcasts rank 0's at the next forward: exact, and no rank says its restored state differs."""
    killed_job_resumes_bitwise(runs, "torchrun", 0, batchnorm=True)
