"""Partition stage, precision: the profile as the device holds it in a mixed-precision run.

A profile is traced and timed in the model's dtype. A run may keep the device copies of
weights and gradients in half precision (the runtime's transfer dtype) and compute under
torch.autocast. `resolve_precision` checks the choice against the profile, and `device_view`
returns the profile with every byte count the device would see: parameters in the transfer
dtype (normalisation weights stay float32, as the runtime keeps them), every value in its
autocast dtype (atomc.partition.autocast), and each operator's saved and working bytes scaled
with its outputs. The cost model and the independent checker both read the view, so the rule
has one owner; times are the profile's (see resolve_precision for when they do not match).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from atomc.dtypes import parse_dtype_name
from atomc.errors import UsageError
from atomc.ir import NodeCost, OpGraph, Profile, TensorSpec
from atomc.partition.autocast import device_dtypes, promote
from atomc.partition.memo import once_per_object
from atomc.units import FLOAT_BYTES

HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class Precision:
    """A run's dtypes: device weights and gradients, and the autocast dtype ("" for none)."""

    transfer_dtype: str
    autocast: str = ""
    notes: tuple[str, ...] = ()  # what the plan should say about the choice

    @property
    def compute_dtype(self) -> str:
        return self.autocast or self.transfer_dtype


def model_dtype(graph: OpGraph) -> str:
    """The dtype of the traced weights (the widest, when they are mixed)."""
    return promote(s.dtype for s in graph.params.values()) or "float32"


def profile_compute_dtype(profile: Profile) -> str:
    """The dtype the profile's times are for."""
    if profile.compute_dtype:
        return profile.compute_dtype
    if profile.hardware is not None:  # an estimate written before the field existed
        return profile.hardware.default_dtype
    return model_dtype(profile.graph)




def resolve_precision(profile: Profile, transfer_dtype: str | None = None,
                      autocast: str | None = None) -> Precision:
    """The run's dtypes, from the options (None: the default; autocast "none": off).

    Defaults: weights travel in the model's dtype; autocast is the transfer dtype when that is
    half (half weights need it: the runtime turns it on), else the compute dtype of an
    estimated profile when that is half (the times assume it). An estimated profile's times
    are for one compute dtype, so a plan computing in another is refused; a measured profile's
    times are kept, with a note.
    """
    model = model_dtype(profile.graph)
    transfer = parse_dtype_name(transfer_dtype, "--transfer-dtype") if transfer_dtype else model
    if FLOAT_BYTES[transfer] > FLOAT_BYTES.get(model, 4):
        raise UsageError(f"--transfer-dtype {transfer} is wider than the model's {model} weights; "
                         f"choose {model} or a half-precision dtype ({', '.join(HALF)})")
    timed = profile_compute_dtype(profile)
    hw = profile.hardware if profile.mode == "estimated" else None
    if autocast == "none":
        if transfer in HALF:
            raise UsageError(f"--autocast none with --transfer-dtype {transfer}: half-precision "
                             f"weights are computed under autocast (the runtime turns it on); "
                             f"drop --autocast or choose --transfer-dtype {model}")
        cast = ""
    elif autocast:
        cast = parse_dtype_name(autocast, "--autocast")
        if cast not in HALF:
            raise UsageError(f"--autocast {cast}: autocast computes in {' or '.join(HALF)}; give "
                             f"one of them, or none")
    elif transfer in HALF:
        cast = transfer
    elif hw is not None and timed in HALF and model in ("float32", *HALF):
        cast = timed
    else:
        cast = ""
    compute = cast or transfer
    if hw is not None and compute != timed:
        if compute not in hw.peak_tflops:
            other = [d for d in HALF if d in hw.peak_tflops] or ["float32"]
            raise UsageError(
                f"hardware profile {hw.name} has no {compute} throughput (it lists "
                f"{', '.join(hw.peak_tflops)}); plan with --transfer-dtype {other[0]}")
        raise UsageError(
            f"the profile's times were estimated for {timed} compute, but this plan computes in "
            f"{compute}; profile again with --compute-dtype {compute}, or plan for {timed}")
    notes: tuple[str, ...] = ()
    if hw is None and compute != timed:
        note = (f"times were measured in {timed}; this plan computes in {compute}, which they do "
                f"not reflect (memory and transfers are planned for {compute})")
        notes = (note,)
    return Precision(transfer, cast, notes)


def device_view(profile: Profile, precision: Precision) -> Profile:
    """`profile` with the device's byte counts for `precision` (itself when nothing changes)."""
    return once_per_object(profile, ("device_view", precision),
                           lambda: _device_view(profile, precision))


def _device_view(profile: Profile, precision: Precision) -> Profile:
    graph = profile.graph
    wide = set(graph.full_precision)
    param_dtypes = {}
    for fqn, spec in graph.params.items():
        narrower = FLOAT_BYTES.get(precision.transfer_dtype, 8) < FLOAT_BYTES.get(spec.dtype, 0)
        param_dtypes[fqn] = (precision.transfer_dtype if narrower and fqn not in wide
                             else spec.dtype)
    dtypes = device_dtypes(graph, param_dtypes, precision.autocast)
    if all(param_dtypes[f] == s.dtype for f, s in graph.params.items()) and all(
            tuple(o.dtype for o in n.outputs) == d for n, d in zip(graph.nodes, dtypes)):
        return profile
    params = {f: _as(s, param_dtypes[f]) for f, s in graph.params.items()}
    nodes = []
    ratios = []
    for node, new in zip(graph.nodes, dtypes):
        outputs = tuple(_as(o, d) for o, d in zip(node.outputs, new))
        before = sum(o.num_bytes for o in node.outputs if o.dtype in FLOAT_BYTES)
        after = sum(o.num_bytes for o in outputs if o.dtype in FLOAT_BYTES)
        ratios.append(after / before if before else 1.0)
        nodes.append(dataclasses.replace(node, outputs=outputs))
    narrowed = [d for f, d in param_dtypes.items() if d != graph.params[f].dtype]
    view = dataclasses.replace(graph, nodes=tuple(nodes), params=params,
                               dtype=narrowed[0] if narrowed else graph.dtype)
    costs = tuple(_scaled_cost(n, c, r, graph, view)
                  for n, c, r in zip(graph.nodes, profile.costs, ratios))
    return dataclasses.replace(profile, graph=view, costs=costs)


def _as(spec: TensorSpec, dtype: str) -> TensorSpec:
    if dtype == spec.dtype or spec.dtype not in FLOAT_BYTES or dtype not in FLOAT_BYTES:
        return spec
    num_bytes = spec.num_bytes * FLOAT_BYTES[dtype] // FLOAT_BYTES[spec.dtype]
    return TensorSpec(spec.shape, dtype, num_bytes)


def _scaled_cost(node, cost: NodeCost, ratio: float, graph: OpGraph, view: OpGraph) -> NodeCost:
    """A node's cost with its activation bytes scaled by `ratio` (its outputs' new bytes over
    their traced bytes) and its own weights and gradients at their device size."""

    def own(g: OpGraph) -> tuple[int, int]:
        fqns = dict.fromkeys(node.param_fqns + node.buffer_fqns)
        params = sum(g.params[f].num_bytes for f in fqns if f in g.params)
        buffers = sum(g.buffers[f].num_bytes for f in fqns if f in g.buffers)
        return params + buffers, params

    was, was_grad = own(graph)
    now, now_grad = own(view)

    def scaled(num_bytes: int) -> int:
        return round(num_bytes * ratio)

    first = cost.param_bytes * now // was if was else cost.param_bytes
    return dataclasses.replace(
        cost, param_bytes=first, output_bytes=scaled(cost.output_bytes),
        saved_bytes=scaled(cost.saved_bytes),
        peak_fwd_bytes=scaled(max(cost.peak_fwd_bytes - was, 0)) + now,
        peak_bwd_bytes=scaled(max(cost.peak_bwd_bytes - was - was_grad, 0)) + now + now_grad,
        load_ms=cost.load_ms * now / was if was else cost.load_ms)
