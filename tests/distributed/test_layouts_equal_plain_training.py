"""One runtime core: a BatchNorm + dropout model trained by layouts (resident and swapped
stages, GPipe and 1F1B, 2x1, 1x2, 2x2) equals plain training in losses, weights and buffers;
peers equal plain copies that average weights and running statistics.

The plain reference follows the runtime's rules: micro-batch m of step s draws its dropout masks
from micro_batch_rng(seed, s, m) (m counted over the global batch), the loss is the mean over
every micro-batch, and running statistics follow replica 0 (as DDP's broadcast_buffers): the
micro-batches of the other replicas leave the reference's buffers as they were.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.distributed.checkpoints import final_state
from atomc.place import place
from atomc.place.network import network_from_data
from atomc.runtime import micro_batch_rng
from atomc.trace import trace_model
from atomc.trace.load import load_model_file

from helpers.torchrun import run_bounded, torchrun_command
from processes import SERIAL

pytestmark = SERIAL
FIXTURE = Path(__file__).parents[1] / "fixtures" / "bn_mlp_model.py"
MICRO, GLOBAL, STEPS, DATA_SEED = 4, 16, 3, 77
bn = load_model_file(FIXTURE)


@pytest.fixture(scope="module")
def bn_work(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("bn_layout")
    traced = trace_model(FIXTURE, None, MICRO, device="cpu")
    plan = plan_from_cuts(traced, [3, 6])
    plan.save(d / "plan.json")
    generate(plan, d / "pkg", traced=traced)
    layouts = {}
    for pp, dp in ((2, 1), (1, 2), (2, 2)):
        n = pp * dp
        net = network_from_data(
            {"devices": [{"name": f"d{i}", "region": "r0"} for i in range(n)],
             "delay_ms": [[0.0 if i == j else 1.0 for j in range(n)] for i in range(n)],
             "bandwidth_gbps": [[0.0 if i == j else 10.0 for j in range(n)] for i in range(n)]},
            "test network")
        path = d / f"layout_{pp}x{dp}.json"
        place(net, pp, dp, plan=plan, budget_s=0.2, compare_random=False).save(path)
        layouts[(pp, dp)] = path
    return {"dir": d, "pkg": d / "pkg", "layouts": layouts}


def reference(dp: int) -> tuple[torch.nn.Module, list[float]]:
    torch.manual_seed(0)
    model = bn.build_model().to(torch.float64).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    total = GLOBAL // MICRO
    local = total // dp
    losses = []
    for s in range(STEPS):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(DATA_SEED * 1_000_003 + s)
            (x,) = bn.example_inputs(None, GLOBAL)
        x = x.to(torch.float64)
        opt.zero_grad()
        step_loss = 0.0
        for m in range(total):
            saved = None if m < local else {n: b.clone() for n, b in model.named_buffers()}
            xm = x[m * MICRO:(m + 1) * MICRO]
            with micro_batch_rng(0, s, m):
                loss = bn.loss_fn(model(xm), (xm,))
            (loss / total).backward()
            step_loss += loss.item() / total
            if saved is not None:
                with torch.no_grad():
                    for n, b in model.named_buffers():
                        b.copy_(saved[n])
        opt.step()
        losses.append(step_loss)
    return model, losses


@pytest.mark.slow
@pytest.mark.parametrize("pp,dp,extra", [
    # the two that make test runs hold a swapped stage first and last, pipelines and replicas
    pytest.param(2, 1, ["--schedule", "gpipe"], marks=pytest.mark.long),
    (2, 1, ["--schedule", "1f1b", "--swap-stages", "1"]),
    pytest.param(2, 1, ["--swap-stages", "0,1"], marks=pytest.mark.long),
    pytest.param(1, 2, [], marks=pytest.mark.long),
    (2, 2, ["--schedule", "1f1b", "--swap-stages", "0"]),
], ids=["2x1-gpipe", "2x1-1f1b-swapped-last", "2x1-all-swapped", "1x2", "2x2-swapped-first"])
def test_batch_norm_and_dropout_layouts_equal_plain_training(bn_work: dict, pp: int, dp: int,
                                                             extra: list[str]) -> None:
    out = bn_work["dir"] / f"run_{pp}x{dp}_{'_'.join(extra) or 'plain'}"
    args = ["--package", str(bn_work["pkg"]), "--steps", str(STEPS), "--global-batch", str(GLOBAL),
            "--micro-batch", str(MICRO), "--data-seed", str(DATA_SEED), "--final-dir", str(out),
            "--timeout", "60", "--dtype", "float64", *extra]
    argv, env = torchrun_command(bn_work["layouts"][(pp, dp)], args)
    r = run_bounded(argv, env, 240)
    assert r.returncode == 0, r.stdout[-4000:]
    buffers: dict[str, torch.Tensor] = {}
    params, losses = final_state(out, pp, buffers)
    model, ref_losses = reference(dp)
    assert [round(losses[s], 12) for s in range(STEPS)] == [round(v, 12) for v in ref_losses]
    ref = dict(model.named_parameters())
    assert set(params) == set(ref)
    for k, p in ref.items():
        torch.testing.assert_close(params[k].to(torch.float64), p.detach(), rtol=0, atol=1e-10)
    ref_buffers = dict(model.named_buffers())
    assert set(buffers) == set(ref_buffers)
    for k, b in ref_buffers.items():
        # num_batches_tracked counts each micro-batch once: recomputation does not update it
        torch.testing.assert_close(buffers[k].to(b.dtype), b, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# peers: full copies that average weights and running statistics after each global batch


def test_batch_norm_and_dropout_peers_equal_plain_copies_that_average(bn_work: dict) -> None:
    """Two peers (swap trainers, as PeerTrainer holds them) at different speeds: after each
    round the peer mode's averaging (round_vector/set_round_vector, weighted by samples) gives
    the plain copies' weighted average of weights and running statistics, the counters
    rounded (3 after round one: 2 and 4 batches weighted 1:2); the optimizer state stays
    local."""
    from atomc.distributed.averaging import round_vector, set_round_vector
    from atomc.runtime import SwapTrainer

    C, rounds = 2, 3
    steps_per_round = {"a": 1, "b": 2}  # b is twice as fast
    torch.manual_seed(0)
    init = bn.build_model().to(torch.float64).state_dict()
    peers = {p: SwapTrainer.from_package(bn_work["pkg"], device="cpu", accum=C, seed=0,
                                         dtype="float64", state_dict=init,
                                         optimizer={"lr": 1e-3, "weight_decay": 0.01})
             for p in steps_per_round}
    plain = {}
    for p in steps_per_round:
        torch.manual_seed(0)
        model = bn.build_model().to(torch.float64).train()
        plain[p] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                                             fused=True))

    def batch(p: str, s: int) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 * ord(p) + s)
            (x,) = bn.example_inputs(None, C * MICRO)
        return x.to(torch.float64)

    step = dict.fromkeys(steps_per_round, 0)
    for _ in range(rounds):
        samples = {}
        for p, n in steps_per_round.items():
            model, opt = plain[p]
            for _ in range(n):
                x = batch(p, step[p])
                swapped = peers[p].step(x)
                opt.zero_grad()
                total = 0.0
                for m, xm in enumerate(x.chunk(C)):
                    with micro_batch_rng(0, step[p], m):
                        loss = bn.loss_fn(model(xm), (xm,))
                    (loss / C).backward()
                    total += loss.item() / C
                opt.step()
                assert abs(swapped - total) < 1e-12
                step[p] += 1
            samples[p] = n * C * MICRO
        weight = sum(samples.values())
        # the round: what hivemind's averager computes from each peer's vector and weight
        mean = sum(round_vector(peers[p]) * samples[p] for p in peers) / weight
        for trainer in peers.values():
            set_round_vector(trainer, mean.clone())
        with torch.no_grad():
            states = {p: plain[p][0].state_dict() for p in plain}
            for k, v in states["a"].items():
                avg = sum(states[p][k].to(torch.float64) * samples[p] for p in plain) / weight
                avg = avg if v.is_floating_point() else avg.round()
                for p in plain:
                    states[p][k].copy_(avg.to(v.dtype))
    for p, trainer in peers.items():
        exported = trainer.export_state_dict()
        ref = plain[p][0].state_dict()
        assert set(exported) == set(ref) and "bn.running_mean" in ref
        for k, v in ref.items():
            torch.testing.assert_close(exported[k].to(v.dtype), v, rtol=0, atol=1e-10, msg=k)
        trainer.close()


def test_a_layouts_final_state_carries_the_weights_no_stage_holds(tmp_path: Path) -> None:
    """Weights the traced graph never reads (an unused pooler, a mask token) belong to no
    stage: the first stage carries them, so that the merged final state loads back into the
    model with strict=True."""
    fixture = Path(__file__).parents[1] / "fixtures" / "unread_weights_model.py"
    traced = trace_model(fixture, None, MICRO, device="cpu")
    plan = plan_from_cuts(traced, [4])
    generate(plan, tmp_path / "pkg", traced=traced)
    net = network_from_data(
        {"devices": [{"name": "d0", "region": "r0"}, {"name": "d1", "region": "r0"}],
         "delay_ms": [[0.0, 1.0], [1.0, 0.0]], "bandwidth_gbps": [[0.0, 10.0], [10.0, 0.0]]},
        "test network")
    layout = tmp_path / "layout.json"
    place(net, 2, 1, plan=plan, budget_s=0.2, compare_random=False).save(layout)
    out = tmp_path / "run"
    args = ["--package", str(tmp_path / "pkg"), "--steps", "2", "--global-batch", str(GLOBAL),
            "--micro-batch", str(MICRO), "--final-dir", str(out), "--timeout", "60"]
    argv, env = torchrun_command(layout, args)
    r = run_bounded(argv, env, 240)
    assert r.returncode == 0, r.stdout[-4000:]
    buffers: dict[str, torch.Tensor] = {}
    params, _ = final_state(out, 2, buffers)
    torch.manual_seed(0)  # the runner's initial weights: the model built under seed 0
    model = load_model_file(fixture).build_model()
    initial = model.state_dict()
    for k in ("pooler.weight", "mask_token", "spare_stats"):  # no stage holds these
        torch.testing.assert_close(params[k], initial[k], rtol=0, atol=0)
    params.update(buffers)  # keeping the modules' format versions the fixture requires
    model.load_state_dict(params, strict=True)


@pytest.mark.parametrize("swapped", [False, True], ids=["resident", "swapped"])
def test_stage_inputs_take_gradients_exactly_when_the_model_gives_them_one(
        tmp_path: Path, swapped: bool) -> None:
    """A layout stage (and a SWARM server's call, which runs one) receives a mixture-of-experts
    router's expert counts (float, no gradient in the model) from the stage before: they stay
    without a gradient, so its int32 cumsum of them runs, and the gradients it sends back are
    those of one autograd graph over the model. The layout's wire says which values carry one."""
    from atomc.distributed.pipeline import value_entries
    from atomc.runtime.optim import AdamWConfig
    from atomc.runtime.package import load_swap_package
    from atomc.stages import cut_stages, make_stage
    from atomc.swarm.calls import BATCH, serve_call

    path = Path(__file__).parents[1] / "models" / "moe.py"
    traced = trace_model(path, None, 2, device="cpu")
    index = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    out = generate(plan_from_cuts(traced, [index["cumsum"]]), tmp_path / "pkg", traced=traced)
    pkg = load_swap_package(out)
    _, second = cut_stages(pkg, ((0, 1), (1, 2)))
    assert "counts" in second.recv and not pkg.carries_grad("counts", 1)  # the histc counts
    subs = pkg.build_submodels()
    pkg.load_original_state_dict(subs, traced.model.state_dict())
    (ids,) = traced.inputs
    with torch.no_grad():
        values = dict(zip(pkg.outputs[0], subs[0](ids)))
    wire = {e.name: e.grad for e in value_entries(values, second.recv, pkg.grads_at(1))}
    assert wire["h"] and not wire["counts"] and not wire["chosen"]  # int64 indices

    leaves = {n: v.detach().requires_grad_(pkg.carries_grad(n, 1)) for n, v in values.items()}
    traced.module.loss_fn(subs[1](*(leaves[n] for n in pkg.inputs[1])), (ids,)).backward()
    stage = make_stage(swapped, pkg, second, torch.device("cpu"), traced.module.loss_fn,
                       AdamWConfig.coerce({"lr": 1e-2}))
    stage.load_original(traced.model.state_dict())
    call = {n: v.clone() for n, v in values.items()}
    call[f"{BATCH}0"] = ids
    grads, loss = serve_call(stage, "backward", call, {"batch_len": 1, "num_micro": 1,
                                                       "micro": 0}, 0)
    assert loss is not None
    for n, g in grads.items():
        if pkg.carries_grad(n, 1):
            torch.testing.assert_close(g, leaves[n].grad, rtol=1e-6, atol=1e-7, msg=n)
        else:  # a stage may answer zeros for a value that takes no gradient
            assert not g.any(), n
    assert {n for n in second.recv if pkg.carries_grad(n, 1)} <= set(grads)
    stage.close()
