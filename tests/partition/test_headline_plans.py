"""The headline GPT-3 plans that docs/gpt3-plans.md quotes (written by bench/gpt3_tables.py,
`make tables`): GPT-3 175B, all 96 blocks, at `--gpu-mem 11GiB` with the default 1 GiB reserve,
on estimated profiles. A change to the cost model, the search or the simulator that moves one
of them fails here, and the tables are to be regenerated (and their explanation reread).

Pinned: whether every constraint is met, the smallest C that meets them all (ATOM's rule), the
C the partitioner takes for the most tokens a second, the number of sub-models within a
tolerance, the predicted GPU busy share and step, and the search's CPU time. Half precision
is ATOM's configuration (an 11 GB GTX 1080 Ti): every constraint is met from C = 3 on both
hosts, and a larger C trains more tokens a second. Float32 weights do not fit: the tied
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
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# CPU seconds for one partition of the 175B graph, every C of the throughput sweep included
# (2-2.5 s where this was written, 3.5 s to refuse float32 with the budget that would fit;
# the whole `atomc partition` command adds Python start-up and reading the profile)
SEARCH_CPU_S = 5.0

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


# (target, transfer dtype, C taken, step recomputing everything, step with activations="auto")
@pytest.mark.parametrize("target, dtype, accum, recompute_s, step_s",
                         [("v100-32gb", "float16", 5, 222.8, 168.3),
                          ("rtx-3090", "bfloat16", 6, 387.0, 292.0)])
def test_175b_at_11gib_in_half_precision_meets_every_constraint_from_c3(profiles, target, dtype,
                                                                        accum, recompute_s,
                                                                        step_s):
    profile = profiles[target]
    plan, spent = _plan(profile, dtype)
    assert plan.feasible and plan.binding == ""
    assert plan.accum == accum and not plan.accum_fixed
    # ATOM's rule, the smallest C meeting every constraint, is 3; the sweep weighs more
    feasible = [p for p in plan.sweep if p.feasible]
    assert min(p.accum for p in feasible) == 3 and len(feasible) >= 3
    best = max(feasible, key=lambda p: p.tokens_per_s)
    assert plan.accum == best.accum
    assert best.tokens_per_s > 1.05 * next(p for p in feasible if p.accum == 3).tokens_per_s
    assert plan.tokens_per_step == accum * 2048
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
    assert 11 * 1024 < budget <= 15 * 1024
    # the budget it names plans
    rate, source = resolve_cpu_adam("auto", profiles["v100-32gb"])
    plan = partition(profiles["v100-32gb"], budget << 20, transfer_dtype="float32",
                     cpu_adam_gbps=rate, cpu_adam_source=source)
    assert plan.feasible


@pytest.fixture(scope="module")
def gpt3_xl():
    """gpt3-xl (1.3B) estimated for an RTX 3090 host."""
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    traced = trace_model(EXAMPLES / "gpt.py", "gpt3-xl", 1, runs_on="cuda")
    return profile_model(traced, target="rtx-3090", progress=False)


def test_more_gpu_memory_never_plans_fewer_tokens_a_second(gpt3_xl):
    """docs/host-plans.md's rule, on GPT-3 XL in bfloat16 on an RTX 3090 host: at 8 and 16 GiB
    the chosen C predicts at least the tokens a second of every other feasible C its sweep
    weighed, and a larger budget never predicts fewer tokens a second than a smaller one (its
    plans include the smaller one's)."""
    rate, source = resolve_cpu_adam("auto", gpt3_xl)
    rates = []
    for gib in (8, 16):
        plan = partition(gpt3_xl, gib * GIB, transfer_dtype="bfloat16", cpu_adam_gbps=rate,
                         cpu_adam_source=source)
        chosen = plan.tokens_per_step / (plan.predicted_step_ms / 1e3)
        assert plan.feasible and len(plan.sweep) >= 2
        assert all(chosen >= p.tokens_per_s * (1 - 1e-9) for p in plan.sweep if p.feasible)
        rates.append(chosen)
    assert rates == sorted(rates), rates


def test_175b_on_lohans_machine_puts_its_states_on_twelve_drives(profiles):
    """docs/host-plans.md's LoHan row at its batch: GPT-3 175B in bfloat16 on an RTX 4090 host
    with 768 GB and 12 drives, C = 16: the host holds what fits of 768 GB and the drives the
    rest of the states; every byte is in the plan."""
    from atomc.ir import DiskSpec
    from atomc.partition.hostmem import HostBudget
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    traced = trace_model(EXAMPLES / "gpt.py", "gpt3-175b", 1, runs_on="cuda")
    profile = profile_model(traced, target="rtx-4090", progress=False)
    rate, source = resolve_cpu_adam("auto", profile)
    host = HostBudget(limit_bytes=768 * 10**9, source="--host-mem",
                      disk=DiskSpec(12, 7.45, 6.9, 2 * 10**12, "given"))
    plan = partition(profile, 22 * GIB, accum=16, transfer_dtype="bfloat16", cpu_adam_gbps=rate,
                     cpu_adam_source=source, host=host)
    assert plan.accum == 16 and plan.host.total() <= 768 * 10**9
    on_disk = sum(plan.host.disk_by_kind.values())
    assert on_disk > 1 << 40  # more than a TiB of masters and moments on the drives
    assert plan.host.disk_need_bytes <= 12 * 2 * 10**12
