"""Layout runner, swapped stages: which stages swap (decided for the schedule that runs, from
the configured budget or the device's memory), and a swapped stage's list names every load the
swap executor makes, for one sub-model too; one-sub-model swapped stages (first, middle, last)
train as plain training does, in float64.

The pipelines here run their stages on threads of this process, one at a time
(helpers.threaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from atomc.actions import Action, max_in_flight, pipeline_order
from atomc.actions.orders import swapped_stage_order
from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.distributed.swapping import DeviceBudget, decide_swaps, device_budget
from atomc.errors import UsageError
from atomc.partition.stagemem import resident_stage_bytes
from atomc.runtime import micro_batch_rng
from atomc.trace import trace_model
from atomc.trace.load import load_model_file

from helpers.threaded import train_on_threads

FIXTURE = Path(__file__).parents[1] / "fixtures" / "bn_mlp_model.py"
MICRO, M, STEPS, DATA_SEED = 4, 4, 2, 77
OPTIMIZER = {"lr": 1e-3, "weight_decay": 0.01, "impl": "fused"}
bn = load_model_file(FIXTURE)


@pytest.fixture(scope="module")
def bn_pkg(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("bn_swap")
    traced = trace_model(FIXTURE, None, MICRO, device="cpu")
    plan = plan_from_cuts(traced, [3, 6])  # three sub-models
    generate(plan, d / "pkg", traced=traced)
    return {"plan": plan, "pkg": d / "pkg"}


# ---------------------------------------------------------------------------------------------
# which stages swap


def _needs(plan: Any, ranges: list[tuple[int, int]], num_micro: int):
    def need(j: int, schedule: str) -> tuple[int, int]:
        flight = max_in_flight(pipeline_order(schedule, num_micro, j, len(ranges)))
        return resident_stage_bytes(plan, *ranges[j], flight), flight
    return need


def _budgets(per_stage: list[list[int | None]]) -> list[list[DeviceBudget]]:
    return [[DeviceBudget(f"d{j}.{i}", b, "test") for i, b in enumerate(row)]
            for j, row in enumerate(per_stage)]


def test_a_stage_that_fits_1f1b_but_not_gpipe_swaps_once_another_stage_makes_it_gpipe(
        bn_pkg: dict) -> None:
    plan = bn_pkg["plan"]
    ranges = [(0, 1), (1, 2), (2, 3)]
    need = _needs(plan, ranges, M)
    (in_1f1b, f1), (in_gpipe, f2) = need(1, "1f1b"), need(1, "gpipe")
    assert (f1, f2) == (2, M) and in_1f1b < in_gpipe
    budget = (in_1f1b + in_gpipe) // 2  # stage 1 fits 1F1B's two micro-batches, not GPipe's M
    assert max(need(j, "gpipe")[0] for j in (0, 2)) <= budget  # the others fit either way
    budgets = _budgets([[budget]] * 3)

    alone = decide_swaps("1f1b", budgets, (), need)
    assert alone.swapped == frozenset() and alone.schedule == "1f1b"
    assert "within" in alone.reasons[1] and "under 1f1b" in alone.reasons[1]

    # stage 2 swapped: the layout runs GPipe, and stage 1 is decided for GPipe's M
    both = decide_swaps("1f1b", budgets, (2,), need)
    assert both.swapped == {1, 2} and both.schedule == "gpipe"
    assert both.reasons[2] == "named in swap_stages"
    assert f"with {M} micro-batch(es) in flight under gpipe, over d1.0's budget" in both.reasons[1]
    lines = both.lines("1f1b")
    assert lines[1].startswith("stage 1 swapped: ") and lines[0].startswith("stage 0 resident: ")
    assert lines[-1].startswith("schedule gpipe instead of 1f1b")
    # configured GPipe: one round, the same stages
    assert decide_swaps("gpipe", budgets, (2,), need).swapped == {1, 2}


def test_a_stage_swaps_on_every_replica_when_one_replicas_device_is_short(bn_pkg: dict) -> None:
    """Replicas of a stage reduce their gradients as one flat buffer: they hold the same kind
    of stage, so the smallest device decides; a device without a figure does not."""
    plan = bn_pkg["plan"]
    ranges = [(0, 2), (2, 3)]
    need = _needs(plan, ranges, M)
    small = need(0, "gpipe")[0] - 1
    d = decide_swaps("gpipe", _budgets([[None, 10**9, small], [None, None, None]]), (), need)
    assert d.swapped == {0}
    assert "over d0.2's budget" in d.reasons[0]
    assert d.reasons[1].startswith("no memory budget for d1.0, d1.1, d1.2")


def test_the_configured_budget_wins_over_the_devices_memory_less_its_reserve() -> None:
    mib = 1 << 20
    assert device_budget("d0", 5 * mib, 80 * mib, "memory_bytes in the network", mib) == \
        DeviceBudget("d0", 5 * mib, "the configured memory budget")
    got = device_budget("d0", None, 80 * mib, "memory_bytes in the network", mib)
    assert got.bytes == 79 * mib
    assert got.source == ("80.00 MiB from memory_bytes in the network, less the reserve of "
                          "1.00 MiB")
    assert device_budget("d0", None, None, "", mib).bytes is None
    with pytest.raises(UsageError, match=r"device d0 has 1\.00 MiB .* leaves nothing"):
        device_budget("d0", None, mib, "memory_bytes in the network", mib)


# ---------------------------------------------------------------------------------------------
# a swapped stage's list: an L for every load


def _slot_replay(actions: list[Action]) -> tuple[list[Action], list[Action]]:
    """The executor's slot rule over one step (sub-model i in slot i % 2, every sub-model
    changed by the last update): the L's that would find their sub-model in its slot already,
    and the F's and B's whose sub-model would not be in its slot (a load the list does not
    name)."""
    holds: dict[int, int] = {}
    idle, unnamed = [], []
    for a in actions:
        if a.kind == "L":
            if holds.get(a.index % 2) == a.index:
                idle.append(a)
            holds[a.index % 2] = a.index
        elif a.kind in "FB" and holds.get(a.index % 2) != a.index:
            unnamed.append(a)
    return idle, unnamed


@pytest.mark.parametrize("holds_output", [True, False], ids=["output", "no-output"])
def test_swapped_stage_order_names_each_load_once(holds_output: bool) -> None:
    for k in range(1, 5):
        for num_micro in (1, 3):
            for stage in (0, 1):
                actions = swapped_stage_order(k, num_micro, stage, holds_output)
                assert _slot_replay(actions) == ([], []), (k, num_micro, stage)
                assert sorted(a.index for a in actions if a.kind == "O") == list(range(k))


# ---------------------------------------------------------------------------------------------
# swapped stages on threads: loads, and training equal to plain training


def _record_loads(ex: Any) -> list[tuple]:
    """Every copy into a weight slot, and whether an L action made it; every L, after."""
    events: list[tuple] = []
    in_load = [False]
    load, loaded_now = ex.load, ex.slots.loaded_now

    def traced_load(index: int, **flags: Any) -> None:
        in_load[0] = True
        try:
            load(index, **flags)
        finally:
            in_load[0] = False
        events.append(("L", index))

    def traced_copy(i: int) -> None:
        events.append(("copy", i, in_load[0]))
        loaded_now(i)

    ex.load, ex.slots.loaded_now = traced_load, traced_copy
    return events


def _reference() -> tuple[torch.nn.Module, list[float]]:
    """Plain float64 training on the same batches, dropout drawn as the runtime draws it."""
    torch.manual_seed(0)
    model = bn.build_model().to(torch.float64).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for m, xm in enumerate(_batch(s).chunk(M)):
            with micro_batch_rng(0, s, m):
                loss = bn.loss_fn(model(xm), (xm,))
            (loss / M).backward()
            total += loss.item() / M
        opt.step()
        losses.append(total)
    return model, losses


def _batch(step: int) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DATA_SEED * 1_000_003 + step)
        (x,) = bn.example_inputs(None, M * MICRO)
    return x.to(torch.float64)


@pytest.mark.parametrize("ranges", [
    ((0, 1), (1, 2), (2, 3)),
    ((0, 2), (2, 3)),
    ((0, 3),),
], ids=["one-sub-model-first-middle-last", "two-then-one", "one-stage"])
def test_swapped_stages_load_what_their_lists_say_and_train_as_plain_training(
        bn_pkg: dict, ranges: tuple[tuple[int, int], ...]) -> None:
    from atomc.runtime.optim import AdamWConfig
    from atomc.runtime.package import load_swap_package
    from atomc.stages import SwappedStage, cut_stages, make_stage

    pkg = load_swap_package(bn_pkg["pkg"])
    specs = cut_stages(pkg, ranges)
    torch.manual_seed(0)
    initial = bn.build_model().state_dict()
    stages = [make_stage(True, pkg, spec, torch.device("cpu"), bn.loss_fn,
                         AdamWConfig.coerce(OPTIMIZER), dtype=torch.float64, seed=0)
              for spec in specs]
    assert all(isinstance(st, SwappedStage) for st in stages)
    for st in stages:
        st.load_original(initial)
    events = [_record_loads(st.ex) for st in stages]
    lists = [st.order("gpipe", M) for st in stages]
    losses = train_on_threads(stages, lists, M, STEPS,
                              lambda s: [(x,) for x in _batch(s).chunk(M)])

    for j, (st, ev) in enumerate(zip(stages, events)):
        # every copy into a slot is an L's, and every L copies: the list says what executes
        assert all(e[2] for e in ev if e[0] == "copy"), (j, ev)
        named = [a.index for a in lists[j] if a.kind == "L"]
        assert [e[1] for e in ev if e[0] == "L"] == named * STEPS
        assert [e[1] for e in ev if e[0] == "copy"] == named * STEPS
        assert sorted(set(named)) == list(range(st.k))

    model, ref_losses = _reference()
    assert [round(x, 12) for x in losses] == [round(x, 12) for x in ref_losses]
    params = {k: v for st in stages for k, v in st.export().items()}
    buffers = {k: v for st in stages for k, v in st.buffers().items()}
    assert set(params) == {k for k, _ in model.named_parameters()}
    for k, p in model.named_parameters():
        torch.testing.assert_close(params[k], p.detach(), rtol=0, atol=1e-10, msg=k)
    for k, b in model.named_buffers():
        torch.testing.assert_close(buffers[k].to(b.dtype), b, rtol=0, atol=1e-10, msg=k)
    for st in stages:
        st.close()
