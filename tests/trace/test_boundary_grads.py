"""A value made without a gradient and filled in place later (`out = torch.zeros_like(x)`, then
`out[:, t] = h` step by step) takes one from its first write on: a cut between writes hands a
gradient back across it. Swap training, layout stages (resident and swapped) and a SWARM
stage's call all give what plain training gives, in float64; the check that runs sub-models as
the runtimes run them (helpers.detached) catches the flag taken at the value's creation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atomc.codegen import generate, load_package
from atomc.codegen.manual import plan_from_cuts
from atomc.runtime import SwapTrainer, micro_batch_rng
from atomc.runtime.package import load_swap_package
from atomc.trace import trace_model
from atomc.trace.load import load_model_file

from helpers.detached import run_detached
from helpers.plain import plain_run
from helpers.threaded import train_on_threads

MODEL = Path(__file__).parents[1] / "models" / "inplace_fill.py"
fill = load_model_file(MODEL)
MICRO, STEPS = 2, 3
FILLS = ("loop", "index-put", "scatter", "new-zeros", "empty")
WRITES = ("copy_", "index_put_", "scatter_", "setitem")
_TRACES: dict = {}


def traced(how: str):
    if how not in _TRACES:
        _TRACES[how] = trace_model(MODEL, how, MICRO, device="cpu")
    return _TRACES[how]


def fill_cuts(t) -> list[int]:
    """Cuts right after the buffer is made (before any write), after the first write and after
    the third: the buffer crosses a cut without a gradient, then twice with one."""
    names = [n.name for n in t.gm.graph.nodes]
    made = next(i for i, n in enumerate(names) if n.startswith(("zeros_like", "new_zeros",
                                                                "empty")))
    writes = [i for i, n in enumerate(names) if n.startswith(WRITES)]
    assert len(writes) == fill.SEQ, names
    return [made + 1, writes[0] + 1, writes[2] + 1]


def fill_package(tmp_path: Path, how: str, accum: int = 1) -> Path:
    t = traced(how)
    return generate(plan_from_cuts(t, fill_cuts(t), accum), tmp_path / f"{how}-{accum}",
                    traced=t)


def buffer_name(pkg) -> str:
    """The filled buffer's boundary name: what sub-model 1 (cut right after it is made)
    receives without a gradient."""
    (name,) = [n for n in pkg.inputs[1] if not pkg.carries_grad(n, 1)]
    return name


def model64(how: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return fill.build_model(how).to(torch.float64).train()


def batches(accum: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, fill.VOCAB, (accum * MICRO, fill.SEQ), generator=g)
            for _ in range(STEPS)]


@pytest.mark.parametrize("how", FILLS)
def test_the_filled_value_takes_a_gradient_at_each_cut_after_its_first_write(tmp_path, how):
    out = fill_package(tmp_path, how)
    pkg = load_swap_package(out)
    buffer = buffer_name(pkg)
    assert [pkg.carries_grad(buffer, i) for i in (1, 2, 3)] == [False, True, True]


@pytest.mark.parametrize("how", FILLS)
@pytest.mark.parametrize("accum", [1, 3])
def test_swap_training_through_an_in_place_fill_equals_adamw(tmp_path, how, accum):
    ref = model64(how)
    trainer = SwapTrainer.from_package(fill_package(tmp_path, how, accum), device="cpu",
                                       state_dict=ref.state_dict(), optimizer={"lr": 1e-2})
    assert trainer.store.master_dtype == torch.float64 and len(trainer.store.layouts) == 4
    data = batches(accum)
    swapped = [trainer.step(b) for b in data]
    plain = plain_run(ref, fill.loss_fn, data, accum)
    assert swapped == pytest.approx(plain, rel=1e-12, abs=1e-12)
    state = trainer.export_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-12, msg=k)
    trainer.close()


@pytest.mark.parametrize("swapped", [False, True], ids=["resident", "swapped"])
def test_layout_stages_through_an_in_place_fill_equal_adamw(tmp_path, swapped):
    """Two stages cut where the filled buffer carries a gradient (sub-models 0-1 | 2-3): the
    link hands it back."""
    from atomc.runtime.optim import AdamWConfig
    from atomc.stages import cut_stages, make_stage

    how, accum = "loop", 2
    pkg = load_swap_package(fill_package(tmp_path, how))
    specs = cut_stages(pkg, ((0, 2), (2, 4)))
    ref = model64(how)
    stages = [make_stage(swapped, pkg, spec, torch.device("cpu"), fill.loss_fn,
                         AdamWConfig.coerce({"lr": 1e-2, "weight_decay": 0.01,
                                             "impl": "fused"}), dtype=torch.float64, seed=0)
              for spec in specs]
    for st in stages:
        st.load_original(ref.state_dict())
    data = batches(accum)
    losses = train_on_threads(stages, [st.order("gpipe", accum) for st in stages], accum, STEPS,
                              lambda s: [(x,) for x in data[s].chunk(accum)])
    plain = plain_run(ref, fill.loss_fn, data, accum)
    assert losses == pytest.approx(plain, rel=1e-12, abs=1e-12)
    params = {k: v for st in stages for k, v in st.export().items()}
    for k, p in ref.named_parameters():
        torch.testing.assert_close(params[k].to(torch.float64), p.detach(), rtol=0, atol=1e-12,
                                   msg=k)
    for st in stages:
        st.close()


@pytest.mark.parametrize("swapped", [False, True], ids=["resident", "swapped"])
def test_a_swarm_stage_hands_back_the_filled_values_gradient(tmp_path, swapped):
    """A SWARM server's backward call on the stage after a cut the buffer crosses with a
    gradient answers the gradient one autograd graph over the model gives that value."""
    from atomc.runtime.optim import AdamWConfig
    from atomc.stages import cut_stages, make_stage
    from atomc.swarm.calls import BATCH, serve_call

    how = "loop"
    pkg = load_swap_package(fill_package(tmp_path, how))
    _, second = cut_stages(pkg, ((0, 2), (2, 4)))
    ref = model64(how)
    subs = [s.double() for s in pkg.build_submodels()]
    pkg.load_original_state_dict(subs, ref.state_dict())
    (ids,) = batches(1)[0:1]
    with micro_batch_rng(0, 0, 0):
        values = dict(zip(pkg.model_inputs, (ids,)))
        for i in range(2):
            values.update(zip(pkg.outputs[i], subs[i](*[values[n] for n in pkg.inputs[i]])))
        # a copy of each value at the cut: its gradient is what the stage after it gives,
        # without what the uses before the cut add to the same tensor's
        at_cut = {n: values[n].clone() for n in second.recv}
        for v in at_cut.values():
            if v.requires_grad:
                v.retain_grad()
        values.update(at_cut)
        for i in range(2, 4):
            out = subs[i](*[values[n] for n in pkg.inputs[i]])
            if i < 3:
                values.update(zip(pkg.outputs[i], out))
        fill.loss_fn(out, (ids,)).backward()
    expected = {n: v.grad for n, v in at_cut.items() if getattr(v, "grad", None) is not None}
    buffer = buffer_name(pkg)
    assert buffer in second.recv and pkg.carries_grad(buffer, 2) and buffer in expected

    stage = make_stage(swapped, pkg, second, torch.device("cpu"), fill.loss_fn,
                       AdamWConfig.coerce({"lr": 1e-2}), dtype=torch.float64, seed=0)
    stage.load_original(ref.state_dict())
    call = {n: v.detach().clone() for n, v in at_cut.items()}
    call[f"{BATCH}0"] = ids
    grads, loss = serve_call(stage, "backward", call, {"batch_len": 1, "num_micro": 1,
                                                       "micro": 0}, 0)
    assert loss is not None
    assert set(expected) <= set(grads)
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-12, atol=1e-12, msg=n)
    stage.close()


def test_the_detached_check_catches_a_flag_taken_when_the_value_is_made(tmp_path, monkeypatch):
    """The bug this file pins, put back on purpose: each value's flag taken right after the node
    that makes it. One autograd graph over the sub-models still gives the model's gradients;
    the sub-models run as the runtimes run them do not, and the check says so."""
    import atomc.codegen.render as render
    from atomc.trace import grad_values

    def at_creation(t):
        return {n: p for n, p in grad_values(t).items() if p < 0}

    monkeypatch.setattr(render, "grad_values", at_creation)
    how = "loop"
    t = traced(how)
    out = fill_package(tmp_path, how)
    package = load_package(out)
    inputs = t.inputs
    model = model64(how)
    fill.loss_fn(model(*inputs), inputs).backward()

    def gradients(detached: bool) -> dict[str, torch.Tensor]:
        subs = [s.double() for s in package.build_submodels()]
        package.load_original_state_dict(subs, model.state_dict())
        if detached:
            run_detached(package, subs, inputs, fill.loss_fn)
        else:
            values = inputs
            for sub in subs[:-1]:
                values = sub(*values)
            fill.loss_fn(subs[-1](*values), inputs).backward()
        return {names[local]: p.grad for sub, names in zip(subs, package.PARAM_NAMES)
                for local, p in sub.named_parameters()}

    def equal(grads: dict[str, torch.Tensor]) -> bool:
        return all(torch.allclose(grads[k], p.grad, rtol=0, atol=1e-10)
                   for k, p in model.named_parameters())

    assert equal(gradients(detached=False))  # one graph hides the wrong flag
    assert not equal(gradients(detached=True))
