"""Profile, the stage's work: `profile_model(traced, ...)`, each operator of a traced model
measured on a device or estimated for a hardware profile (see the package docstring).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from tqdm import tqdm

from atomc import __version__
from atomc.device import describe_device, parse_device
from atomc.errors import ProfileError
from atomc.ir import IssueTimes, NodeCost, Profile, RuntimeCosts
from atomc.profile.estimate import estimate_ms, load_ms
from atomc.profile.hardware import load_hardware
from atomc.profile.measure import Measured, measure, size_peaks
from atomc.profile.ops import MetaStats, analyse, materialise
from atomc.profile.timing import CopyTimer, time_ms
from atomc.trace import TracedModel
from atomc.trace.graph import tensors_in
from atomc.units import format_bytes

COMPUTE_OPS = ("call_module", "call_function", "call_method")


def _loss_costs(traced: TracedModel, dev: torch.device,
                repeats: int) -> tuple[float, float, int, int] | str | None:
    """Forward and backward ms and working bytes of the model file's loss_fn on outputs and a
    batch of the traced shapes (None without a loss_fn; a note when it cannot run on such
    made-up values). Bytes: the allocator's peaks on CUDA; elsewhere what autograd saves and
    the loss, then the saved tensors and the outputs' gradients."""
    fn = getattr(traced.module, "loss_fn", None)
    if not callable(fn):
        return None
    out_node = next(n for n in reversed(traced.gm.graph.nodes) if n.op == "output")
    cuda = dev.type == "cuda"
    try:
        outputs = materialise(fx.node.map_arg(out_node.args[0], lambda n: traced.values[n.name]),
                              dev, seed=3)
        batch = materialise(traced.inputs, dev, seed=4,
                            constants=frozenset(id(t) for t in tensors_in(traced.inputs)))
        leaves = [t for t in tensors_in(outputs) if t.requires_grad]
        with torch.enable_grad():
            fwd_ms = time_ms(lambda: fn(outputs, batch), dev, repeats=repeats)
            if cuda:
                torch.cuda.synchronize(dev)
                base = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            saved: dict[int, int] = {}

            def keep(t: torch.Tensor) -> torch.Tensor:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                # detached: a saved output packed as itself would hold its own grad_fn, a
                # cycle through autograd that no collector sees (the tensors would leak)
                return t.detach()

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss = fn(outputs, batch)
            if not isinstance(loss, torch.Tensor):
                return fwd_ms, 0.0, 0, 0
            if cuda:
                torch.cuda.synchronize(dev)
                peak_fwd = torch.cuda.max_memory_allocated(dev) - base
            else:  # the outputs themselves are the sub-model's, not the loss's
                mine = {t.untyped_storage().data_ptr() for t in tensors_in(outputs)}
                held = sum(n for ptr, n in saved.items() if ptr not in mine)
                peak_fwd = held + loss.untyped_storage().nbytes()
            if not leaves or not loss.requires_grad:
                return fwd_ms, 0.0, int(peak_fwd), 0
            bwd_ms = time_ms(lambda: torch.autograd.grad(loss, leaves, retain_graph=True,
                                                         allow_unused=True), dev, repeats=repeats)
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
                torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)
                torch.cuda.synchronize(dev)
                peak_bwd = torch.cuda.max_memory_allocated(dev) - base
            else:
                peak_bwd = held + sum(t.untyped_storage().nbytes() for t in leaves)
    except Exception as e:  # noqa: BLE001 - a loss that needs real data is left out, with a note
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"loss_fn not timed ({type(e).__name__}: {why}); the plan leaves it out"
    return fwd_ms, bwd_ms, int(peak_fwd), int(peak_bwd)


_WARM: set[str] = set()


def _warm_up(gm: Any, values: Any, nodes: list, dev: torch.device) -> None:
    """Every operator once, untimed, in the process's first profile on `dev`: a cold process
    (lazy kernel and allocator set-up) timed its first profile's operators up to 30% slower
    than the profiles after it."""
    if str(dev) in _WARM:
        return
    _WARM.add(str(dev))
    for node in nodes:
        try:
            measure(gm, node, values, analyse(gm, node, values), dev, 1)
        except Exception:  # noqa: BLE001 - the timed pass reports what fails
            return


# On a CPU, every operator is measured in this many rounds over all of them, and each takes the
# median of its rounds: a shared CPU slows down in bursts longer than one operator's repeats
# (one operator of the mini GPT read 1.8x in one profile of four), and an operator of a
# repeated block is measured once for all its copies, so one burst moved a whole profile by
# up to 40%. A GPU's times did not swing so: one round there.
CPU_ROUNDS = 3


def _median_of_rounds(rounds: list[Measured]) -> Measured:
    """Each time the median of the rounds' (working memory: the first round's)."""
    if len(rounds) == 1:
        return rounds[0]

    def median(get: Any) -> float:
        return statistics.median(get(m) for m in rounds)

    issue = rounds[0].issue
    if issue is not None:
        issue = IssueTimes(*(median(lambda m, f=f: getattr(m.issue, f.name))
                             for f in dataclasses.fields(issue)))
    return dataclasses.replace(rounds[0], fwd_ms=median(lambda m: m.fwd_ms),
                               bwd_ms=median(lambda m: m.bwd_ms), issue=issue)


def _measure_operators(traced: TracedModel, unique_sigs: list[str], dev: torch.device | None,
                       repeats: int, progress: bool | None, rounds: int | None,
                       ) -> tuple[dict[str, MetaStats], dict[str, Measured], int]:
    """Each operator signature's shapes and sizes, and on a device its times (the median of
    `rounds`), from the first node that has it; and the rounds taken."""
    gm, values, graph = traced.gm, traced.values, traced.graph
    stats_by_sig: dict[str, MetaStats] = {}
    measured: dict[str, Measured] = {}
    first_node = {}
    for fx_node, op in zip(list(gm.graph.nodes), graph.nodes):
        if op.op in COMPUTE_OPS and op.signature not in first_node:
            first_node[op.signature] = fx_node
    bar = tqdm(unique_sigs, desc=f"profiling {len(unique_sigs)} unique operators", unit="op",
               disable=(not progress) if progress is not None else None, leave=False)
    if dev is not None:
        _warm_up(gm, values, [first_node[sig] for sig in unique_sigs], dev)
    if rounds is None:
        rounds = CPU_ROUNDS if dev is not None and dev.type == "cpu" else 1
    if rounds < 1:
        raise ProfileError(f"rounds {rounds} must be 1 or more")
    by_round: dict[str, list[Measured]] = {sig: [] for sig in unique_sigs}
    for r in range(rounds if dev is not None else 1):
        for sig in bar if r == 0 else unique_sigs:
            node = first_node[sig]
            try:
                if sig not in stats_by_sig:
                    stats_by_sig[sig] = analyse(gm, node, values)
                if dev is not None:
                    by_round[sig].append(measure(gm, node, values, stats_by_sig[sig], dev,
                                                 repeats))
            except Exception as e:
                raise ProfileError(f"profiling operator {node.name} ({node.op} {node.target}) "
                                   f"failed: {type(e).__name__}: {e}") from e
    if dev is not None:
        measured = {sig: _median_of_rounds(ms) for sig, ms in by_round.items()}
    return stats_by_sig, measured, rounds


def _node_costs(graph: Any, stats_by_sig: dict[str, MetaStats], measured: dict[str, Measured],
                dev: torch.device | None, copy_timer: CopyTimer | None, hw: Any,
                compute_dtype: str | None) -> list[NodeCost]:
    """One NodeCost per graph node: measured on `dev`, or estimated for hardware `hw`. A weight
    is loaded by the first node that reads it; a repeated operator is "reused"."""
    seen: set[str] = set()
    costs: list[NodeCost] = []
    counted: set[str] = set()
    specs = {**graph.params, **graph.buffers}
    for op in graph.nodes:
        resident = [f for f in op.param_fqns + op.buffer_fqns if f not in seen]
        seen.update(resident)
        param_bytes = sum(specs[f].num_bytes for f in resident)
        if dev is not None:
            assert copy_timer is not None
            node_load_ms = copy_timer.load_ms(param_bytes)
        else:
            assert hw is not None
            node_load_ms = load_ms(param_bytes, hw.h2d_gbps, hw.launch_overhead_us)
        if op.op not in COMPUTE_OPS:
            out_bytes = sum(t.num_bytes for t in op.outputs) if op.op == "placeholder" else 0
            costs.append(NodeCost(op.name, param_bytes, out_bytes, 0, out_bytes, 0, 0.0, 0.0,
                                  node_load_ms, 0, 0, "estimated" if hw else "measured"))
            continue
        s = stats_by_sig[op.signature]
        issue = None
        if dev is not None:
            m = measured[op.signature]
            fwd_ms, bwd_ms, issue = m.fwd_ms, m.bwd_ms, m.issue
            peak_fwd, peak_bwd = m.peak_fwd_bytes, m.peak_bwd_bytes
            source = "reused" if op.signature in counted else "measured"
        else:
            assert hw is not None and compute_dtype is not None
            fwd_ms, bwd_ms = estimate_ms(s, hw, compute_dtype)
            peak_fwd, peak_bwd = size_peaks(s)
            source = "reused" if op.signature in counted else "estimated"
        counted.add(op.signature)
        costs.append(NodeCost(
            name=op.name, param_bytes=param_bytes, output_bytes=s.output_bytes,
            saved_bytes=s.saved_bytes,
            peak_fwd_bytes=peak_fwd, peak_bwd_bytes=peak_bwd, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
            load_ms=node_load_ms, fwd_flops=s.fwd_flops, bwd_flops=s.bwd_flops, source=source,
            issue=issue,
        ))
    return costs


def _add_loss_costs(traced: TracedModel, costs: list[NodeCost], dev: torch.device,
                    repeats: int) -> str:
    """Measure the model file's loss_fn onto the output node's cost; the profile's note on it
    ("" without a loss_fn)."""
    loss = _loss_costs(traced, dev, repeats)
    if isinstance(loss, str):
        return loss
    if loss is None:
        return ""
    # the last sub-model computes the loss in every step: its times and working memory ride on
    # the output node, which is always there
    out = max(i for i, n in enumerate(traced.graph.nodes) if n.op == "output")
    costs[out] = dataclasses.replace(costs[out], fwd_ms=loss[0], bwd_ms=loss[1],
                                     peak_fwd_bytes=loss[2], peak_bwd_bytes=loss[3])
    return (f"loss_fn measured on the output node: forward {loss[0]:.3f} ms, "
            f"backward {loss[1]:.3f} ms, working memory {format_bytes(max(loss[2], loss[3]))}")


def profile_model(traced: TracedModel, *, device: str | None = None, target: str | None = None,
                  compute_dtype: str | None = None, repeats: int = 5,
                  progress: bool | None = None, rounds: int | None = None,
                  runtime_costs: Callable[[torch.device], RuntimeCosts] | None = None) -> Profile:
    """A measured profile on `device` (`repeats` timed calls per operator, median; on a CPU in
    CPU_ROUNDS rounds unless `rounds` says) or an estimated one for hardware `target`.

    A measured profile holds the runtime's own costs on `device` when the caller passes
    `runtime_costs` (atomc.calibrate.measure_runtime_costs: measuring them runs the runtime,
    a layer above this one); without it they are not measured and plans charge none."""
    if device is not None and target is not None:
        raise ProfileError("give either --device (measure) or --target (estimate), not both")
    hw = load_hardware(target) if target is not None else None
    dev = parse_device(device, ProfileError) if hw is None else None
    if hw is not None:
        compute_dtype = compute_dtype or hw.default_dtype
        if compute_dtype not in hw.peak_tflops:
            raise ProfileError(f"hardware profile {hw.name} has no peak for {compute_dtype}; "
                               f"choose one of {', '.join(hw.peak_tflops)}")

    graph = traced.graph
    copy_timer = CopyTimer(dev) if dev is not None else None
    unique_sigs = list(dict.fromkeys(n.signature for n in graph.nodes if n.op in COMPUTE_OPS))
    stats_by_sig, measured, rounds = _measure_operators(traced, unique_sigs, dev, repeats,
                                                        progress, rounds)
    costs = _node_costs(graph, stats_by_sig, measured, dev, copy_timer, hw, compute_dtype)
    loss_note = _add_loss_costs(traced, costs, dev, repeats) if dev is not None else ""

    num_compute = sum(1 for n in graph.nodes if n.op in COMPUTE_OPS)
    if hw is not None:
        h2d, d2h = hw.h2d_gbps, hw.d2h_gbps
        where = hw.name
        notes: tuple[str, ...] = (f"compute dtype {compute_dtype}",)
    else:
        assert copy_timer is not None and dev is not None
        h2d, d2h = copy_timer.bandwidth_gbps(), copy_timer.d2h_gbps()
        where = describe_device(dev)
        notes = (f"{repeats} timed repeats in each of {rounds} rounds, median",
                 *((loss_note,) if loss_note else ()),
                 *(() if runtime_costs else ("the runtime's own costs not measured",)))
    runtime = runtime_costs(dev) if dev is not None and runtime_costs is not None else None
    return Profile(
        graph=graph, costs=tuple(costs), mode="estimated" if hw else "measured", device=where,
        hardware=hw, h2d_gbps=h2d, d2h_gbps=d2h, num_unique=len(unique_sigs),
        num_reused=num_compute - len(unique_sigs), atomc_version=__version__, notes=notes,
        compute_dtype=compute_dtype if hw is not None else graph.dtype, runtime=runtime,
    )


