"""The headline GPT-3 plans that docs/gpt3-plans.md quotes (written by bench/gpt3_tables.py,
`make tables`): GPT-3 175B, all 96 blocks, at `--gpu-mem 11GiB` with the default 1 GiB reserve,
on estimated profiles. A change to the cost model, the search or the simulator that moves one
of them fails here, and the tables are to be regenerated (and their explanation reread).

Pinned: whether every constraint is met, C, the number of sub-models within a tolerance, the
predicted GPU busy share, and the search's time. Half precision is ATOM's configuration (an
11 GB GTX 1080 Ti): it plans at C = 3 on both hosts. Float32 weights do not fit: the tied
embedding / LM head weight alone is 2.30 GiB, so the runtime's four slots take 9.21 GiB of
the 10 GiB, and no last sub-model's working memory fits beside them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from atomc.calibrate.host import resolve_cpu_adam
from atomc.errors import InfeasiblePlanError
from atomc.partition import partition
from atomc.partition.check import check_plan

GIB = 1 << 30
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# CPU seconds for one partition of the 175B graph (about 0.5-1 s where this was written; the
# whole `atomc partition` command adds Python and torch start-up and reading the profile)
SEARCH_CPU_S = 4.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def profiles():
    """gpt3-175b estimated for a V100 32 GB host (PCIe 3) and an RTX 3090 host (PCIe 4), as
    `atomc profile examples/gpt.py --config gpt3-175b --target T` makes them."""
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    traced = trace_model(EXAMPLES / "gpt.py", "gpt3-175b", 1, runs_on="cuda")
    return {t: profile_model(traced, target=t, progress=False) for t in ("v100-32gb", "rtx-3090")}


def _plan(profile, dtype: str, gib: int = 11):
    rate, source = resolve_cpu_adam("auto", profile)
    start = time.process_time()
    try:
        plan = partition(profile, gib * GIB, transfer_dtype=dtype, cpu_adam_gbps=rate,
                         cpu_adam_source=source)
    finally:
        spent = time.process_time() - start
    return plan, spent


# (target, transfer dtype, step recomputing everything, step with activations="auto")
@pytest.mark.parametrize("target, dtype, recompute_s, step_s",
                         [("v100-32gb", "float16", 133.9, 111.8),
                          ("rtx-3090", "bfloat16", 194.1, 188.8)])
def test_175b_at_11gib_in_half_precision_meets_every_constraint_at_c3(profiles, target, dtype,
                                                                      recompute_s, step_s):
    profile = profiles[target]
    plan, spent = _plan(profile, dtype)
    assert plan.feasible and plan.binding == ""
    assert plan.accum == 3 and not plan.accum_fixed
    assert 285 <= len(plan.submodels) <= 295
    assert plan.predicted_utilisation >= 0.99
    assert plan.predicted_step_ms == pytest.approx(step_s * 1e3, rel=0.02)
    assert plan.activations == "auto"
    assert plan.recompute_step_ms == pytest.approx(recompute_s * 1e3, rel=0.02)
    assert spent < SEARCH_CPU_S, f"partition took {spent:.1f} s of CPU"
    # the runtime's slots: four of the largest sub-model fit beside every one's working memory
    assert all(s.slack_memory_bytes >= 0 for s in plan.submodels)
    assert not check_plan(profile, plan)
    # sub-model 1's update outlasts the embedding's backward: the step says by how much
    assert any(n.startswith("step boundary: sub-model 0's update waits") for n in plan.notes)


def test_175b_at_11gib_with_float32_weights_does_not_fit_and_says_what_would(profiles):
    start = time.process_time()
    with pytest.raises(InfeasiblePlanError) as e:
        _plan(profiles["v100-32gb"], "float32")
    assert time.process_time() - start < SEARCH_CPU_S
    msg = str(e.value)
    assert "no partition fits 11.00 GiB" in msg and "slots" in msg
    budget = int(msg.split("--gpu-mem ")[1].split("MiB")[0])
    assert 11 * 1024 < budget <= 14 * 1024
