"""The wider survey of Hugging Face families: test_models.py's four checks (chained sub-models
equal the model in float64 and float32, SwapTrainer equals AdamW, a bfloat16 plan trains
within 1%) on 95 more tiny random families (tests/models/hf_families.py). About 50 minutes on
two cores, so not in `make test`: run it with `make families` (pytest -m families).

Left out, each for a reason of transformers' own (the eager model fails the same way): Mixtral,
OLMoE, Qwen2-MoE, XGLM, CANINE and MRA in float64 (no float64 CPU kernel for grouped matrix
products; XGLM's mask overflows float32; CANINE's eager logits are NaN; MRA casts to float32
with `.float()` and then multiplies by float64 weights). The bfloat16 check of the tiny
BatchNorm models (ResNet, MobileNetV2, LeViT: a BatchNorm1d after every linear layer, over
micro-batches of 2) holds the plan to what bfloat16 rounding moves their eager loss, which is
tens of percent where a transformer's is tenths.
"""

from __future__ import annotations

import pytest
import torch

from atomc.trace import load_model_file

from helpers.model_chain import (
    FAMILIES,
    check_bfloat16_plan_trains_within_one_percent,
    check_chained_submodels_equal_the_model,
    check_swap_trainer_equals_adamw,
)

pytest.importorskip("transformers")

NAMES = load_model_file(FAMILIES).NAMES
NOT_IN_FLOAT64 = {"hf-canine", "hf-mixtral", "hf-mra", "hf-olmoe", "hf-qwen2-moe", "hf-xglm"}
# Known misses not yet explained, as (check, case) -> what was measured: they must fail as
# recorded (strict), so a fix shows as a pass that takes them out of this list. None now: the
# survey of 2026-11-25 found two, WavLM's swap trainer (fixed: the activation stash kept no
# memory order) and LeViT's bfloat16 plan (bfloat16 rounding moves its eager loss as far)
KNOWN: dict[tuple[str, str], str] = {}


def _known(request, check: str, name: str) -> None:
    if (check, name) in KNOWN:
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=KNOWN[(check, name)]))


CASES = sorted(f"hf-{n}" for n in NAMES)

pytestmark = pytest.mark.families


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("name", CASES)
def test_chained_submodels_equal_the_model(models_root, name, dtype, tol):
    if dtype == torch.float64 and name in NOT_IN_FLOAT64:
        pytest.skip("transformers' own model does not run in float64 on a CPU")
    check_chained_submodels_equal_the_model(models_root, name, dtype, tol)


@pytest.mark.parametrize("name", CASES)
def test_swap_trainer_equals_adamw(models_root, name, request):
    _known(request, "swap", name)
    # float32 over three steps: with two threads BEiT's losses are 1.7e-6 apart (one thread:
    # within 1e-6), as sub-model boundaries change which kernels reduce in what order; the
    # float64 chain above holds the same model to 1e-10
    # MRA's query weights get gradients of about 1e-7 (its attention keeps the top blocks of a
    # low-resolution copy), which Adam's per-element scaling turns into steps where rounding
    # shows: 2.1e-6 apart after three steps, every loss equal
    check_swap_trainer_equals_adamw(models_root, name, rel=5e-6 if name == "hf-beit" else 1e-6,
                                    atol=5e-6 if name == "hf-mra" else 1e-6)


@pytest.mark.parametrize("name", CASES)
def test_bfloat16_plan_trains_within_one_percent(models_root, name, request):
    _known(request, "bfloat16", name)
    check_bfloat16_plan_trains_within_one_percent(models_root, name)
