"""DDP launched by ``torchrun --nproc_per_node=2``: a killed job resumes bitwise."""

from __future__ import annotations

from typing import Any

import pytest
from ddp_cases import killed_job_resumes_bitwise

pytestmark = [pytest.mark.ddp, pytest.mark.slow]


def test_killed_job_resumes_bitwise(runs: Any) -> None:
    killed_job_resumes_bitwise(runs, "torchrun", 0)
