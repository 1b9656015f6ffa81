"""bench/survey.py's judgement of a model whose float32 training misses plain AdamW's: it
passes only where the two runs agree in float64 and float32 moves AdamW's own losses at least
as far; a difference in float64 is a wrong gradient, whatever float32 did."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import survey  # noqa: E402

from helpers import model_chain as mc  # noqa: E402


def _run(swapped, plain, weight=1.0, moved=0.0) -> mc.ThreeSteps:
    state = {"w": torch.full((3,), weight, dtype=torch.float64)}
    return mc.ThreeSteps(swapped, plain, state, {"w": state["w"] + moved})


def test_float32_rounding_within_the_model_s_own_drift_passes_with_a_note():
    run32 = _run([1.50, 1.61, 1.58], [1.50, 1.60, 1.57])
    run64 = _run([1.50, 1.55, 1.52], [1.50, 1.55, 1.52])
    weight, note = survey._float32_amplifies_rounding(mc, run32, run64)
    assert weight == 0.0
    assert note.startswith("float32 amplifies rounding") and "equal in float64" in note


def test_a_float32_gap_beyond_the_model_s_own_drift_differs():
    run32 = _run([1.50, 1.70, 1.58], [1.50, 1.55, 1.52])
    run64 = _run([1.50, 1.55, 1.52], [1.50, 1.55, 1.52])
    with pytest.raises(AssertionError, match="beyond"):
        survey._float32_amplifies_rounding(mc, run32, run64)


@pytest.mark.parametrize("run64", [
    _run([1.50, 1.55, 1.52], [1.50, 1.55 + 1e-6, 1.52]),  # losses apart in float64
    _run([1.50, 1.55, 1.52], [1.50, 1.55, 1.52], moved=1e-7),  # or weights
])
def test_a_difference_in_float64_differs_however_far_float32_drifts(run64):
    run32 = _run([1.50, 1.61, 1.58], [1.50, 1.90, 1.20])
    with pytest.raises(AssertionError):
        survey._float32_amplifies_rounding(mc, run32, run64)
