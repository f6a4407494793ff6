"""The FP8 training check on a GPU (issue 23): tools/fp8_convergence.py's router + MoE regression task, 300 AdamW
steps in FP8 and in BF16 from the same seed; both curves printed; no NaN, learning, FP8's final loss within 2% of
BF16's. The record lands in bench/results/ when the tool runs as a script (`python tools/fp8_convergence.py`)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import fp8_convergence as F  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.fp8, pytest.mark.training]


def test_fp8_training_matches_bf16():
    rec = F.run_check(F.Task(), torch.device("cuda"))
    F.print_curves(rec)
    assert rec["ok"], "; ".join(rec["failures"])
