"""Schedule IR: the text form, ATOM's order and the pipeline orders, the simulator timing them."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from atomc.actions import (
    GRAMMAR,
    Action,
    ActionKind,
    atom_order,
    atom_runs,
    format_actions,
    gpipe,
    max_in_flight,
    one_f_one_b,
    parse_actions,
    phases,
    pipeline_order,
    runs,
)
from atomc.cli import main
from atomc.errors import UsageError
from atomc.partition import partition
from atomc.simulate import StageTimes, simulate_actions, simulate_swap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from synthetic import MB, block_profile

MS = 1_000_000


# ---------------------------------------------------------------------------------------------
# text form


def test_text_round_trip_of_every_kind():
    actions = [Action("F", 12, 345), Action("B", 0, 10), Action("L", 101), Action("O", 7),
               Action("U", 23), Action("S", 4, 99), Action("R", 11, 0)]
    assert {a.kind for a in actions} == set(ActionKind)
    text = format_actions(actions)
    assert text == "12F345 0B10 101L 7O 23U 4S99 11R0"
    assert parse_actions(text) == actions
    assert format_actions(actions, per_line=3) == "12F345 0B10 101L\n7O 23U 4S99\n11R0"
    assert parse_actions(format_actions(actions, per_line=3)) == actions
    assert parse_actions(" 12F345,0B10 ,\n101L\t7O 23U 4S99 11R0\n") == actions
    assert parse_actions("") == []


@pytest.mark.parametrize("token", ["2X0", "1L3", "0U0", "F0", "2F", "2f0", "-1F0", "2F0x", "L"])
def test_a_bad_token_is_named_with_the_grammar(token):
    with pytest.raises(UsageError) as err:
        parse_actions(f"0L {token} 0F0")
    assert repr(token) in str(err.value) and GRAMMAR in str(err.value)


def test_actions_check_their_micro_batch():
    for bad in (("F", 0, None), ("S", 1, None), ("L", 0, 1), ("U", 2, 0), ("Q", 0, 0),
                ("F", -1, 0)):
        with pytest.raises(ValueError):
            Action(*bad)


# ---------------------------------------------------------------------------------------------
# ATOM's order


@pytest.mark.parametrize("k,early,expected", [
    (1, False, "0L 0F0 0B0 0F1 0B1 0O 0U"),
    (1, True, "0L 0F0 0B0 0F1 0B1 0O 0U"),  # nothing to prefetch early
    (2, False, "0L 1L 0F0 0F1 1F0 1B0 1F1 1B1 1O 1U 0B0 0B1 0O 0U"),
    (2, True, "0L 0F0 0F1 1F0 1B0 1F1 1B1 1O 1U 0B0 0B1 0O 0U 1L"),
    (3, False, "0L 1L 0F0 0F1 2L 1F0 1F1 2F0 2B0 2F1 2B1 2O 2U 0L 1B0 1B1 1O 1U 0B0 0B1 0O 0U"),
    (3, True, "0L 0F0 0F1 2L 1F0 1F1 2F0 2B0 2F1 2B1 2O 2U 0L 1B0 1B1 1O 1U 0B0 0B1 0O 0U 1L"),
])
def test_atom_order(k, early, expected):
    assert format_actions(atom_order(k, 2, early_prefetch=early)) == expected


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("early", [False, True])
def test_atom_order_keeps_two_slots_and_every_micro_batch(k, accum, early):
    order = atom_order(k, accum, early_prefetch=early)
    assert runs(order) == atom_runs(k, accum, early_prefetch=early)
    for kind in "FB":
        assert sorted((a.index, a.micro) for a in order if a.kind == kind) == \
            [(i, m) for i in range(k) for m in range(accum)]
    held = [0, 1 if early and k > 1 else None]  # what the previous step left in the slots
    for pos, a in enumerate(order):
        if a.kind == "L":
            held[a.index % 2] = a.index
        elif a.kind in "FB":
            assert held[a.index % 2] == a.index, (pos, a)  # computes with its own weights
        elif a.kind == "U":  # updated after its gradients left, once per step
            assert order.index(Action("O", a.index)) < pos
    # P_{k-2} is not loaded again between its forward and its backward
    if k > 1:
        fwd = max(p for p, a in enumerate(order) if a == Action("F", k - 2, accum - 1))
        bwd = order.index(Action("B", k - 2, 0))
        assert Action("L", k - 2) not in order[fwd:bwd]


def test_phases_put_a_load_with_the_compute_it_is_for():
    lines = [format_actions(p) for p in phases(atom_order(3, 2, early_prefetch=True))]
    assert lines == ["0L 0F0 0F1", "2L 1F0 1F1", "2F0 2B0 2F1 2B1 2O 2U", "0L 1B0 1B1 1O 1U",
                     "0B0 0B1 0O 0U 1L"]


# ---------------------------------------------------------------------------------------------
# pipeline orders


def _old_gpipe(num_micro):
    """atomc.distributed.pipeline's lists before the IR: F and B per micro-batch only."""
    return [("F", m) for m in range(num_micro)] + [("B", m) for m in range(num_micro)]


def _old_one_f_one_b(num_micro, stage, num_stages):
    warm = min(num_stages - stage - 1, num_micro)
    ops = [("F", m) for m in range(warm)]
    for k in range(num_micro - warm):
        ops += [("F", warm + k), ("B", k)]
    return ops + [("B", m) for m in range(num_micro - warm, num_micro)]


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("num_micro", [1, 3, 8])
def test_pipeline_orders_keep_the_old_compute_order(pp, num_micro):
    for j in range(pp):
        for name, actions, old in (
                ("gpipe", gpipe(num_micro, j, pp), _old_gpipe(num_micro)),
                ("1f1b", one_f_one_b(num_micro, j, pp), _old_one_f_one_b(num_micro, j, pp))):
            assert actions == pipeline_order(name, num_micro, j, pp)
            assert [(a.kind, a.micro) for a in actions if a.kind in "FB"] == old
            assert {a.index for a in actions} == {j}
            wires = [str(a)[len(str(j)):] for a in actions]  # kinds and micro-batches
            for m in range(num_micro):
                f, b = wires.index(f"F{m}"), wires.index(f"B{m}")
                assert (wires[f - 1] == f"R{m}") == (j > 0)  # values in before F
                assert (wires[f + 1] == f"S{m}") == (j < pp - 1)  # ... and on after it
                assert (wires[b - 1] == f"R{m}") == (j < pp - 1)  # gradients back before B
                assert (b + 1 < len(wires) and wires[b + 1] == f"S{m}") == (j > 0)
        assert max_in_flight(gpipe(num_micro, j, pp)) == num_micro
        assert max_in_flight(one_f_one_b(num_micro, j, pp)) == min(pp - j, num_micro)


def test_one_f_one_b_by_hand():
    assert format_actions(one_f_one_b(3, 1, 3)) == \
        "1R0 1F0 1S0 1R1 1F1 1S1 1R0 1B0 1S0 1R2 1F2 1S2 1R1 1B1 1S1 1R2 1B2 1S2"


def test_unknown_pipeline_order():
    with pytest.raises(UsageError, match="gpipe, 1f1b"):
        pipeline_order("interleaved", 4, 0, 2)


# ---------------------------------------------------------------------------------------------
# the simulator times the list


def _stage(fwd, bwd, load, ckpt=0, off=0, opt=0) -> StageTimes:
    return StageTimes(fwd * MS, bwd * MS, load * MS, ckpt * MS, off * MS, opt * MS)


def test_simulated_step_by_hand_keeps_the_last_but_one_in_its_slot():
    # C = 2: every micro-batch takes half of a sub-model's time. P1's load (3) outlasts P2's
    # whole backward (2): a reload of P1 there would stall the compute lane for 1.
    stages = [_stage(2, 4, 1, off=1, opt=1), _stage(4, 8, 3, off=1, opt=1),
              _stage(2, 2, 2, off=1, opt=1)]
    sim = simulate_swap(stages, accum=2)
    compute = [(e.submodel, e.kind[0], e.start_ms, e.end_ms)
               for e in sim.timeline.lane_events("compute")]
    assert compute == [(0, "f", 0, 2), (1, "f", 3, 7),  # P1 waits for its load (0 to 3)
                       (2, "f", 7, 8), (2, "b", 8, 9), (2, "f", 9, 10), (2, "b", 10, 11),
                       (1, "b", 11, 19), (0, "b", 19, 23)]
    loads = [(e.submodel, e.kind, e.start_ms, e.end_ms)
             for e in sim.timeline.lane_events("prefetch")]
    # P0's load lands behind P2's gradients leaving the same slot (11 to 12); then the refresh
    # waits for P0's update (24 to 25)
    assert loads == [(1, "load", 0, 3), (2, "load", 3, 5), (0, "load", 11, 12),
                     (0, "refresh", 25, 26)]
    assert sim.step_ns == 26 * MS
    assert sim.compute_ns == 22 * MS


@pytest.mark.parametrize("seed", range(25))
def test_the_swap_simulation_is_the_simulation_of_atom_order(seed):
    rng = random.Random(seed)
    k, accum = rng.randint(1, 6), rng.randint(1, 4)
    stages = [StageTimes(*(rng.randint(0, 10**6) for _ in range(6))) for _ in range(k)]
    early = rng.random() < 0.5
    order = atom_order(k, accum, early_prefetch=early)
    a = simulate_swap(stages, accum, num_steps=2, early_prefetch=early)
    b = simulate_actions(order, stages, accum, num_steps=2)
    assert a == b


@pytest.mark.parametrize("text,why", [
    ("0L 0F0 1S0", "1S0"),  # a pipeline message: not a swap lane's work
    ("0L 1F0 0F0", "0F0, whose output"),
    ("0L 0F0 0B0 1F0 1B0", "1B0, whose output gradient"),
    ("0L 0F2", "C=2"),
    ("0L 2L", "2 sub-models"),
])
def test_the_simulator_rejects_a_list_it_cannot_run(text, why):
    with pytest.raises(ValueError, match=why):
        simulate_actions(parse_actions(text), [_stage(1, 1, 1)] * 2, 2)


# ---------------------------------------------------------------------------------------------
# atomc show --schedule


def test_show_prints_the_schedule(tmp_path, capsys):
    plan = partition(block_profile(num_blocks=6), 40 * MB, reserve_bytes=0)
    path = plan.save(tmp_path / "p.plan.json")
    assert main(["show", str(path), "--schedule"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("schedule of one step"):].splitlines()
    k = len(plan.submodels)
    assert f"{k} sub-models, C={plan.accum}" in lines[0] and "L load weights" in lines[0]
    order = atom_order(k, plan.accum, early_prefetch=plan.early_prefetch)
    assert parse_actions(" ".join(lines[1:])) == order
    assert sum(1 for line in lines[1:] if not line.startswith("    ")) == len(phases(order))
