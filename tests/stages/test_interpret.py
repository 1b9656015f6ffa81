"""The Executor seam: one interpreter of the action IR (atomc.runtime.interpret.run_actions)
drives every runtime through the operations atomc.runtime.interpret.Executor declares, after
checking the list's kinds against the ones the executor runs.

A fake Executor records what the interpreter asks of it: through GPipe, 1F1B, ATOM's order and a
swapped stage's order it is asked for exactly the list's actions, in order, with the sends and
receives going the right way, each micro-batch on its own RNG stream (replayed for a
recomputation, carried on the wire), and the buffers a recomputation sees as they were before
its forward. SWARM's calls are one micro-batch's Executor operations: a forward call is the
stage's forwards of that micro-batch, a backward call its forwards again and its backwards,
which leave the running statistics as the forward call left them; the resident and the
swapped stage answer both alike.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from atomc.actions import Action, ActionKind, atom_order, directions, gpipe, one_f_one_b
from atomc.actions.orders import swapped_stage_order
from atomc.errors import AtomcError
from atomc.runtime.interpret import Executor, run_actions
from atomc.runtime.rng import RNG_VALUE, micro_batch_rng

SEED, STEP, FIRST = 3, 5, 2


class FakeStage:
    """Records every operation as the action it stands for; its forward draws a number on the
    current RNG stream and bumps a buffer, its backward (a recomputation) draws again."""

    device = torch.device("cpu")
    action_kinds = frozenset(ActionKind)

    def __init__(self, recompute: bool = True):
        self.recompute = recompute
        self.log: list[Action] = []
        self.flags: list[tuple] = []
        self.bn = nn.Module()
        self.bn.register_buffer("count", torch.zeros(()))
        self.drawn: dict[tuple[int, int], torch.Tensor] = {}
        self.replayed: dict[tuple[int, int], torch.Tensor] = {}
        self.seen: dict[tuple[int, int], float] = {}  # the buffer a forward or backward read
        self.values: dict[int, dict] = {}

    @contextmanager
    def session(self, micro_batches, step):
        assert step == STEP
        self.micro = micro_batches
        yield

    @contextmanager
    def exchange(self):
        yield

    def recomputes(self, index):
        return self.recompute

    def forward_modules(self, index):
        return [self.bn]

    def forward(self, index, micro, *, last):
        self.log.append(Action("F", index, micro))
        self.flags.append(("F", index, micro, last))
        self.drawn[(index, micro)] = torch.rand(())
        self.seen[("F", index, micro)] = float(self.bn.count)
        self.bn.count += 1  # a running statistic

    def backward(self, index, micro, *, first, last):
        self.log.append(Action("B", index, micro))
        self.flags.append(("B", index, micro, first, last))
        if self.recompute:  # the forward again: same draws, same buffers, updated on a copy
            self.replayed[(index, micro)] = torch.rand(())
            self.seen[("B", index, micro)] = float(self.bn.count)
            self.bn.count += 1

    def load(self, index, *, next_first_backward, trailing):
        self.log.append(Action("L", index))
        self.flags.append(("L", index, next_first_backward, trailing))

    def offload(self, index):
        self.log.append(Action("O", index))

    def update(self, index):
        self.log.append(Action("U", index))

    def take_values(self, micro, values):
        assert RNG_VALUE not in values
        self.values[micro] = values

    def take_grads(self, micro, grads):
        assert set(grads) == {"h"}

    def values_out(self, micro):
        return {"h": torch.full((2,), float(micro))}

    def grads_out(self, micro):
        return {"h": torch.ones(2)}

    def losses(self):
        return []


class FakeLinks:
    """Records each S and R as an action with the way it went; what R brings carries an RNG
    state (`state_of`)."""

    def __init__(self, stage: int, state_of=None):
        self.stage = stage
        self.log: list[tuple[Action, str]] = []
        self.sent: dict[int, dict] = {}
        self.state_of = state_of or {}

    def recv(self, m):
        self.log.append((Action("R", self.stage, m), "values"))
        out = {"h": torch.zeros(2)}
        if m in self.state_of:
            out[RNG_VALUE] = self.state_of[m]
        return out

    def recv_grads(self, m):
        self.log.append((Action("R", self.stage, m), "grads"))
        return {"h": torch.ones(2)}

    def send(self, m, values):
        self.log.append((Action("S", self.stage, m), "values"))
        self.sent[m] = values

    def send_grads(self, m, grads, received):
        self.log.append((Action("S", self.stage, m), "grads"))
        assert set(grads) == set(received) == {"h"}


LISTS = {
    **{f"gpipe-{j}": gpipe(3, j, 3) for j in range(3)},
    **{f"1f1b-{j}": one_f_one_b(4, j, 3) for j in range(3)},
    "atom": atom_order(4, 3),
    "atom-early": atom_order(4, 3, early_prefetch=True),
    "swapped-middle": swapped_stage_order(3, 2, 1, False),
    "swapped-last": swapped_stage_order(3, 2, 2, True),
}


def test_a_fake_stage_is_an_executor() -> None:
    assert isinstance(FakeStage(), Executor)


@pytest.mark.parametrize("name", sorted(LISTS))
def test_run_actions_asks_the_stage_for_exactly_the_lists_actions(name: str) -> None:
    actions = LISTS[name]
    stage = FakeStage()
    j = actions[0].index
    links = FakeLinks(j)
    before = torch.get_rng_state()
    run_actions(stage, actions, [()] * 4, links, seed=SEED, step=STEP, first_micro=FIRST)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is as it was
    # every action, in the list's order: compute and weights by the stage, S and R by links
    done, wire = iter(stage.log), iter(links.log)
    for a, way in zip(actions, directions(actions)):
        if a.kind in "SR":
            assert next(wire) == (a, way)
        else:
            assert next(done) == a
    assert next(done, None) is None and next(wire, None) is None
    # the flags are the list's
    for flag in stage.flags:
        kind, i = flag[:2]
        pos = [p for p, a in enumerate(actions) if a.kind == kind and a.index == i]
        if kind == "F":
            at = actions.index(Action("F", i, flag[2]))
            assert flag[3] == (at == pos[-1])
        elif kind == "B":
            at = actions.index(Action("B", i, flag[2]))
            assert flag[3:] == (at == pos[0], at == pos[-1])
    # a sent value carries its micro-batch's RNG state; a recomputation replays the forward's
    for values in links.sent.values():
        assert values[RNG_VALUE].dtype == torch.uint8
    assert stage.replayed and all(stage.replayed[k] == stage.drawn[k] for k in stage.replayed)


def test_each_micro_batch_draws_from_its_stream_and_a_received_state_continues_it() -> None:
    """Micro-batch m's first forward draws what micro_batch_rng(seed, step, first + m) draws;
    one whose state arrived with its values continues the sender's stream."""
    # stage 0 of two sends; stage 1 receives the states and continues them
    sender, links0 = FakeStage(), FakeLinks(0)
    run_actions(sender, gpipe(2, 0, 2), [()] * 2, links0, seed=SEED, step=STEP, first_micro=FIRST)
    for m in range(2):
        with micro_batch_rng(SEED, STEP, FIRST + m):
            assert sender.drawn[(0, m)] == torch.rand(())
    receiver = FakeStage()
    links1 = FakeLinks(1, {m: links0.sent[m][RNG_VALUE] for m in range(2)})
    run_actions(receiver, gpipe(2, 1, 2), [()] * 2, links1, seed=SEED, step=STEP,
                first_micro=FIRST)
    for m in range(2):
        with micro_batch_rng(SEED, STEP, FIRST + m):
            torch.rand(())  # the sender's draw
            assert receiver.drawn[(1, m)] == torch.rand(())


def test_a_recomputation_sees_the_buffers_of_its_forward_and_updates_them_once() -> None:
    stage = FakeStage()
    run_actions(stage, atom_order(3, 2), [()] * 2, seed=SEED, step=STEP)
    # each F bumped the buffer once; each B read what its F read, and bumped a copy
    assert float(stage.bn.count) == len([a for a in atom_order(3, 2) if a.kind == "F"])
    for (kind, i, m), value in stage.seen.items():
        if kind == "B":
            assert value == stage.seen[("F", i, m)]
    # a stage that keeps its graphs is not recomputed: no replay, nothing saved
    kept = FakeStage(recompute=False)
    run_actions(kept, atom_order(3, 2), [()] * 2, seed=SEED, step=STEP)
    assert not kept.replayed


def test_forwards_that_repeat_earlier_ones_leave_the_buffers_alone() -> None:
    """`recomputing`: a SWARM backward call repeats the forward call's forward."""
    stage = FakeStage()
    run_actions(stage, gpipe(2, 0, 2), [()] * 2, FakeLinks(0), seed=SEED, step=STEP,
                recomputing=True)
    assert float(stage.bn.count) == 0
    assert all(v == 0 for v in stage.seen.values())


def test_a_list_that_sends_needs_links() -> None:
    with pytest.raises(ValueError, match="without links"):
        run_actions(FakeStage(), gpipe(1, 0, 2), [()], seed=SEED, step=STEP)


class ComputeOnly(FakeStage):
    """An executor that runs F, B, S and R only, as a resident stage does: its load, offload
    and update are taken away."""

    action_kinds = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.SEND,
                              ActionKind.RECEIVE})
    load = offload = update = None


@pytest.mark.parametrize("kind", ["L", "O", "U"])
def test_a_kind_the_executor_does_not_run_is_refused_before_the_list_runs(kind: str) -> None:
    stage = ComputeOnly()
    actions = [Action("F", 0, 0), Action(kind, 0), Action("B", 0, 0)]
    with pytest.raises(AtomcError, match=f"ComputeOnly runs F B S R actions; the list has 0{kind}"):
        run_actions(stage, actions, [()], seed=SEED, step=STEP)
    assert stage.log == []  # nothing of it ran
    run_actions(stage, gpipe(1, 0, 1), [()], FakeLinks(0), seed=SEED, step=STEP)
    assert stage.log == [Action("F", 0, 0), Action("B", 0, 0)]


def test_actions_are_dispatched_by_kind_not_by_name() -> None:
    """Every kind has a handler in the interpreter's table, and the table names no other."""
    import ast

    import atomc.runtime.interpret as interpret

    source = Path(interpret.__file__).read_text()
    assert "getattr(" not in source
    table = {n.attr for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
             and n.value.id == "ActionKind"}
    assert table == {k.name for k in ActionKind}


def test_the_interpreter_and_the_executor_do_not_import_each_other() -> None:
    import ast

    import atomc.runtime.interpret as interpret

    tree = ast.parse(Path(interpret.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "atomc.runtime.executor" not in imported


# ---------------------------------------------------------------------------------------------
# SWARM: a call is one micro-batch's Executor operations, on a resident or a swapped stage

FIXTURE = Path(__file__).parents[1] / "fixtures" / "bn_mlp_model.py"
MICRO = 4


@pytest.fixture(scope="module")
def bn_pkg(tmp_path_factory: pytest.TempPathFactory):
    from atomc.codegen import generate
    from atomc.codegen.manual import plan_from_cuts
    from atomc.runtime.package import load_swap_package
    from atomc.trace import trace_model

    d = tmp_path_factory.mktemp("interpret_bn")
    traced = trace_model(FIXTURE, None, MICRO, device="cpu")
    generate(plan_from_cuts(traced, [3, 6]), d / "pkg", traced=traced)
    return load_swap_package(d / "pkg")


def _stages(pkg, j: int) -> dict:
    """Stage j of two (sub-models [0, 2) and [2, 3)), resident and swapped, float64, with the
    model's initial weights; their forward and backward calls recorded."""
    from atomc.runtime.optim import AdamWConfig
    from atomc.stages import cut_stages, make_stage
    from atomc.trace.load import load_model_file

    module = load_model_file(FIXTURE)
    torch.manual_seed(0)
    state = module.build_model().to(torch.float64).state_dict()
    spec = cut_stages(pkg, ((0, 2), (2, 3)))[j]
    out = {}
    for swapped in (False, True):
        st = make_stage(swapped, pkg, spec, torch.device("cpu"), module.loss_fn, AdamWConfig(),
                        dtype=torch.float64, seed=SEED)
        st.load_original(state)
        executor = st.ex if swapped else st
        st.calls = []
        for kind in ("forward", "backward"):
            op = getattr(executor, kind)

            def recorded(index, micro, *, _op=op, _kind=kind, _st=st, **flags):
                _st.calls.append((_kind[0].upper(), index, micro, torch.is_grad_enabled()))
                return _op(index, micro, **flags)

            setattr(executor, kind, recorded)
        out["swapped" if swapped else "resident"] = st
    return out


def _call(st, kind: str, values: dict, step: int = 1, micro: int = 2):
    from atomc.swarm.calls import serve_call

    st.calls.clear()
    meta = {"batch_len": 1, "num_micro": MICRO, "micro": micro}
    return serve_call(st, kind, dict(values), meta, step)


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_swarm_calls_are_one_micro_batch_stage_operations(bn_pkg) -> None:
    from atomc.swarm.calls import BATCH, GRAD

    g = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO, 6, generator=g, dtype=torch.float64)
    first, last = _stages(bn_pkg, 0), _stages(bn_pkg, 1)
    assert isinstance(first["resident"], Executor) and isinstance(first["swapped"].ex, Executor)
    assert not any(hasattr(first["resident"], op) for op in ("load", "offload", "update"))

    # stage 0's forward call: the forwards of one micro-batch, without autograd
    sent = {}
    for name, st in first.items():
        before = {k: b.clone() for k, b in st.buffers().items()}
        sent[name], loss = _call(st, "forward", {f"{BATCH}0": x})
        assert loss is None
        indices = (0,) if name == "resident" else (0, 1)
        assert st.calls == [("F", i, 0, False) for i in indices]
        # the running statistics moved once
        after = st.buffers()
        assert any(not torch.equal(before[k], after[k]) for k in after)
        assert all(int(after[k]) == int(before[k]) + 1 for k in after if "num_batches" in k)
    _same(sent["resident"], sent["swapped"])
    buffers = {name: {k: b.clone() for k, b in st.buffers().items()}
               for name, st in first.items()}

    # its backward call: those forwards again, then the backwards; the buffers stay as the
    # forward call left them (counters included), the gradients are the same on both stages
    grads_in = {f"{GRAD}{n}": torch.randn(v.shape, generator=g, dtype=v.dtype)
                for n, v in sent["resident"].items()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and n != RNG_VALUE}
    assert grads_in
    for name, st in first.items():
        back, loss = _call(st, "backward", {f"{BATCH}0": x, **grads_in})
        assert back == {} and loss is None  # the first stage sends no gradients back
        indices = (0,) if name == "resident" else (0, 1)
        assert st.calls == ([("F", i, 0, True) for i in indices]
                            + [("B", i, 0, True) for i in reversed(indices)])
        _same(st.buffers(), buffers[name])
    grads = {name: {k: p.grad for k, p in st.named_parameters()} for name, st in first.items()}
    _same(grads["resident"], grads["swapped"])

    # the last stage gets no forward call: its backward call is the micro-batch's forward
    # (buffers updated) and backward; the loss is the mean over the step's micro-batches
    results = {}
    for name, st in last.items():
        before = {k: b.clone() for k, b in st.buffers().items()}
        results[name] = _call(st, "backward", {f"{BATCH}0": x, **sent["resident"]})
        assert all(int(st.buffers()[k]) == int(before[k]) + 1
                   for k in before if "num_batches" in k)
        assert [c[0] for c in st.calls] == ["F", "B"]
    (back_r, loss_r), (back_s, loss_s) = results["resident"], results["swapped"]
    assert loss_r == loss_s and back_r
    _same(back_r, back_s)
    grads = {name: {k: p.grad for k, p in st.named_parameters()} for name, st in last.items()}
    _same(grads["resident"], grads["swapped"])
    for st in (*first.values(), *last.values()):
        st.close()
