"""The IR every stage passes on: frozen dataclasses with JSON round trips.

model.py -trace-> OpGraph -profile-> Profile -partition-> Plan -codegen-> package

The IR holds no torch objects: nodes are named by their torch.fx names, modules and
parameters by fully qualified name (FQN). Each document is written with `kind` and
`schema_version`; the loader rejects other kinds, other versions and malformed fields with a
message that names the file and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from atomc.ir.documents import Document, to_data
from atomc.jsonio import canonical_hash

# ---------------------------------------------------------------------------------------------
# traced graph


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    num_bytes: int


@dataclass(frozen=True)
class OpNode:
    """One torch.fx node, in topological order."""

    name: str
    op: str  # placeholder | get_attr | call_module | call_function | call_method | output
    target: str  # module FQN, attribute FQN, qualified function name or method name
    # the module the node runs in ("" at top level); the module itself for call_module
    module_fqn: str
    module_type: str  # class name of the called module, or of the innermost owning module
    block: str  # FQN of the repeated block the node belongs to ("" outside blocks)
    inputs: tuple[str, ...]  # names of nodes whose values this node reads
    outputs: tuple[TensorSpec, ...]  # flattened tensor outputs
    param_fqns: tuple[str, ...]  # canonical FQNs of parameters the node reads
    buffer_fqns: tuple[str, ...]
    signature: str  # equal signatures cost the same: measured once
    # the dtype a constant dtype argument of the node names (`.to(torch.float32)`, softmax's
    # dtype=, new_ones' dtype=), which fixes its output's dtype on any device; "" when the
    # node has none or takes the dtype from a value (`x.to(y.dtype)` in an fx trace)
    cast_to: str = ""


@dataclass(frozen=True)
class OpGraph(Document):
    KIND: ClassVar[str] = "atomc.graph"
    OPTIONAL: ClassVar[tuple[str, ...]] = ("frozen",)

    model_path: str
    config: str | None
    batch_size: int
    options: dict[str, int]  # model-file keyword options, e.g. {"seq_len": 2048}
    frontend: str  # "fx" or "export"
    dtype: str  # parameter dtype
    nodes: tuple[OpNode, ...]
    params: dict[str, TensorSpec]  # canonical FQN -> spec; tied weights appear once
    buffers: dict[str, TensorSpec]
    aliases: dict[str, str]  # other FQN of a tied parameter -> canonical FQN
    blocks: tuple[str, ...] = ()  # FQNs of repeated blocks in order (e.g. blocks.0 .. blocks.95)
    # parameters of normalisation layers: kept in float32 on the device when the other weights
    # travel in half precision (atomc.trace.graph.is_norm_weight)
    full_precision: tuple[str, ...] = ()
    # parameters the model freezes (requires_grad=False): no gradient, moments or update
    # (None in files written before it was recorded: every weight trains)
    frozen: tuple[str, ...] | None = None

    def structure_hash(self) -> str:
        """Hash of what the model computes (nodes and parameters), not where it came from."""
        data = {"nodes": to_data(self.nodes), "params": to_data(self.params),
                "frontend": self.frontend}
        return canonical_hash(data)

    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in self.params.values())

    def node_index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}


# ---------------------------------------------------------------------------------------------
# profile


@dataclass(frozen=True)
class HardwareProfile:
    """A GPU as the estimator sees it; files live in profiles/ and cite their sources."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("host_memory_bytes",)

    name: str
    description: str
    memory_bytes: int
    peak_tflops: dict[str, float]  # dtype -> dense tensor-core or FMA peak, TFLOP/s
    mem_gbps: float  # device memory bandwidth, GB/s
    h2d_gbps: float  # achievable pinned host-to-device, GB/s
    d2h_gbps: float
    compute_efficiency: float  # fraction of peak FLOP/s large matmuls reach
    launch_overhead_us: float
    sources: tuple[str, ...]
    default_dtype: str = "float32"  # the compute dtype estimates assume unless told otherwise
    # fused AdamW throughput of a host such a GPU is sold in, GB/s of fp32 masters (0: none
    # given); where the figure comes from is one of `sources`
    host_adam_gbps: float = 0.0
    # memory of that host a run on one such GPU may take (None: not stated; plans for the
    # target are then checked only against --host-mem); its source is one of `sources`
    host_memory_bytes: int | None = None


@dataclass(frozen=True)
class IssueTimes:
    """A node's time on a device that runs behind the host (CUDA), its two sides apart.

    The host issues work ahead of the device: a run of operators whose kernels are long lets
    the host's issuing of the next ones hide behind them, and operators whose issuing is the
    longer leave the device idle between kernels. `NodeCost.fwd_ms` is the longer of the two
    alone; a range of nodes costs the longer of the two sides' sums (partition.tables).
    """

    device_fwd_ms: float
    device_bwd_ms: float
    host_fwd_ms: float
    host_bwd_ms: float


@dataclass(frozen=True)
class NodeCost:
    OPTIONAL: ClassVar[tuple[str, ...]] = ("issue",)

    name: str
    param_bytes: int  # bytes of parameters first used here (a tied weight counts once)
    output_bytes: int
    saved_bytes: int  # tensors autograd keeps for the backward
    # working memory while running forward (inputs, params, outputs, temporaries)
    peak_fwd_bytes: int
    peak_bwd_bytes: int
    fwd_ms: float
    bwd_ms: float
    load_ms: float  # host-to-device copy of param_bytes
    fwd_flops: int
    bwd_flops: int
    source: str  # "measured", "reused" (same signature measured elsewhere) or "estimated"
    # measured on CUDA: device and host time apart (None: on the CPU, where the two are one,
    # in estimates, and in calibrated profiles, whose times are fitted to whole sub-models)
    issue: IssueTimes | None = None


@dataclass(frozen=True)
class SubmodelCalibration:
    """What one sub-model of the measured plan took, and the factors its nodes were scaled by.

    Times are medians over the measured steps; forward and backward are per micro-batch, the
    backward with the recomputation the runtime did (none in the last sub-model).
    """

    index: int
    start: int  # node range [start, stop) of the plan
    stop: int
    fwd_scale: float  # calibrated / profiled forward time of each of its nodes
    bwd_scale: float  # calibrated / profiled backward time (recomputation at the new forward)
    measured_fwd_ms: float
    measured_bwd_ms: float
    measured_load_ms: float  # one load of its weights (0: never loaded in the measured steps)
    measured_checkpoint_ms: float  # its C micro-batches' checkpoints streamed in
    measured_offload_ms: float  # its gradients to the host
    measured_optimizer_ms: float  # its CPU update


@dataclass(frozen=True)
class Calibration:
    """How a profile was calibrated: from which plan's measured steps, on which device."""

    plan_hash: str  # the plan whose generated package was trained
    source_profile_hash: str  # the profile before calibration (the plan was made from it)
    device: str  # where the steps ran, as profiles name devices
    num_steps: int  # measured steps (medians are over them)
    warmup_steps: int  # steps run first and not measured
    accum: int
    submodels: tuple[SubmodelCalibration, ...]
    h2d_scale: float  # calibrated / profiled host-to-device bandwidth (1: nothing measured)
    d2h_scale: float
    # the runtime's CPU update rate, GB/s of fp32 masters (0: no update measured)
    cpu_adam_gbps: float
    measured_step_ms: float  # median step, start to start
    predicted_step_ms: float  # the plan's prediction from the profile alone
    calibrated_step_ms: float  # the plan's cuts simulated on the calibrated profile
    # on a CPU device: the runtime thread's time of its own before each action (the Python
    # between them, and what its copies take beyond bytes over bandwidth); 0 on a GPU
    host_gap_ms: float = 0.0


@dataclass(frozen=True)
class RuntimeCosts:
    """The swap runtime's own costs on the profiled device, which no operator's time holds;
    measured with the runtime's code (atomc.calibrate.runtime_costs)."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("forward_ms", "backward_ms")

    # one sub-model's CPU AdamW update: a fixed part, and a part per parameter tensor (the
    # kernels run tensor by tensor); its bytes go at the plan's CPU update rate
    update_ms: float
    update_tensor_ms: float
    # on a CPU device, the runtime thread's own time before each action it runs (the Python
    # that drives it); 0 where the device runs the actions on its own streams
    action_ms: float = 0.0
    # on a CPU device, the runtime's own time inside one sub-model's forward and inside its
    # backward (the recomputed forward included), one micro-batch, beyond its operators'
    # (None: not measured; on a GPU the device's time is the kernels', which the profile holds)
    forward_ms: float | None = None
    backward_ms: float | None = None


@dataclass(frozen=True)
class Profile(Document):
    KIND: ClassVar[str] = "atomc.profile"
    OPTIONAL: ClassVar[tuple[str, ...]] = ("calibration", "runtime")

    graph: OpGraph
    costs: tuple[NodeCost, ...]  # same order as graph.nodes
    mode: str  # "measured" or "estimated"
    device: str  # what the numbers are for: "cpu", "cuda:0 (NVIDIA H100 ...)", or a target name
    hardware: HardwareProfile | None
    h2d_gbps: float  # bandwidth load_ms was computed or measured with
    d2h_gbps: float
    num_unique: int  # operators actually measured or estimated
    num_reused: int  # operators that reused an equal signature's numbers
    atomc_version: str = ""
    notes: tuple[str, ...] = ()
    # the dtype the times are for: the estimate's compute dtype, or the dtype measured in
    # ("" in older files: the graph's dtype)
    compute_dtype: str = ""
    # set by `atomc calibrate`: node times scaled to measured steps (None: as profiled)
    calibration: Calibration | None = None
    # measured profiles: the runtime's fixed costs on the device (None: not measured, taken as 0)
    runtime: RuntimeCosts | None = None

    def totals(self) -> dict[str, float]:
        keys = ("param_bytes", "output_bytes", "saved_bytes", "fwd_ms", "bwd_ms", "load_ms",
                "fwd_flops", "bwd_flops")
        return {k: sum(getattr(c, k) for c in self.costs) for k in keys}


# ---------------------------------------------------------------------------------------------
# plan


@dataclass(frozen=True)
class CutTensor:
    """A value crossing a cut: produced by node `name` before it, read after it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    num_bytes: int


@dataclass(frozen=True)
class Submodel:
    index: int
    start: int  # first node index in the profile's graph (inclusive)
    stop: int  # last node index + 1
    first_node: str
    last_node: str
    layers: tuple[str, ...]  # module FQNs whose operators fall in this range
    param_bytes: int  # unique parameters (and buffers) resident while it computes
    peak_bytes: int  # resident + working memory for C micro-batches
    fwd_ms: float  # one micro-batch
    # one micro-batch, recomputation included when activations are recomputed (not in the last
    # sub-model: it keeps its autograd graph from forward to backward)
    bwd_ms: float
    load_ms: float
    offload_ms: float  # gradients back to the host
    slack_memory_bytes: int  # capacity - (this computing + next loading); >= 0 when feasible
    slack_fwd_ms: float  # C*t_fwd(this) - t_load(next)
    # C*t_bwd(this) - max(t_load(previous), t_offload(next)): next's gradients leave meanwhile
    slack_bwd_ms: float
    inputs: tuple[CutTensor, ...]  # values it reads from earlier sub-models or the model's inputs
    outputs: tuple[CutTensor, ...]  # values later sub-models or the model's output read
    # added by the partition stage (defaults keep older plan files readable):
    checkpoint_ms: float = 0.0  # its C micro-batches' checkpoints, streamed in during its backward
    optimizer_ms: float = 0.0  # CPU AdamW over its fp32 masters
    slack_optimizer_ms: float = 0.0  # C*t_bwd + t_offload(this) - (t_offload + t_opt)(next)
    # every value crossing the cut after it (incl. pass-through)
    crossing: tuple[CutTensor, ...] = ()
    # activations="auto": outputs of heavy operators (one micro-batch) kept on the device or
    # sent to host memory from its forward to its backward, whose recomputation skips them
    kept: tuple[str, ...] = ()  # the operators (node names) whose outputs are kept
    sent: tuple[str, ...] = ()  # ... and sent
    kept_bytes: int = 0
    sent_bytes: int = 0
    recompute_saved_ms: float = 0.0  # recomputation skipped, one micro-batch (in bwd_ms)
    send_ms: float = 0.0  # its C micro-batches' sent outputs to the host, during its forward
    fetch_ms: float = 0.0  # ... and back, before its backward (in checkpoint_ms)
    # the disk tier: its states on disk read before its update and written after it, and its
    # image read before each load when that is on disk (0: all on the host)
    disk_read_ms: float = 0.0
    disk_write_ms: float = 0.0
    image_read_ms: float = 0.0


@dataclass(frozen=True)
class DiskSpec:
    """The drives a plan may put model states on: how many, each one's sequential read and
    write rate (GB/s) and capacity (0: unknown), and where the figures come from."""

    drives: int
    read_gbps: float
    write_gbps: float
    capacity_bytes: int = 0
    source: str = ""


@dataclass(frozen=True)
class HostMemory:
    """The host bytes a plan's run allocates (atomc.partition.hostmem) and the check made."""

    by_kind: dict[str, int]  # masters, optimizer_states, transfer_copies, gradient_buffers, ...
    optimizer_states: str  # dtype of AdamW's moments: float32 or bfloat16
    trainable_params: int
    frozen_params: int  # no gradient buffer, moments or update
    limit_bytes: int  # 0: not checked
    limit_source: str  # "--host-mem", "available on <host>", a hardware profile's figure, ""
    # host gradient buffers taken in turn (a ring; 0: one per sub-model, as clipping needs)
    grad_slots: int = 0
    # the disk tier: the drives, each sub-model's kinds of states on disk ("moments",
    # "masters", "images"), their bytes by kind, and what the drives must have free (a
    # record written beside the current one, and a checkpoint's links keeping one set)
    disk: DiskSpec | None = None
    disk_kinds: tuple[tuple[str, ...], ...] = ()
    disk_by_kind: dict[str, int] = field(default_factory=dict)
    disk_need_bytes: int = 0

    def total(self) -> int:
        return sum(self.by_kind.values())


@dataclass(frozen=True)
class SweepPoint:
    """One accumulation degree C the partitioner weighed for throughput: the step it predicts,
    the tokens a second that gives, and the resource that binds the step."""

    accum: int
    step_ms: float
    tokens_per_s: float
    gpu_busy: float  # compute-lane busy fraction of the step
    binding: str  # the lane busiest over the step: "GPU compute", "CPU update", ...
    feasible: bool  # every constraint met (else loads or lanes stall, or the host is short)
    searched: bool  # its own search's plan (else a smaller C's cuts costed at this C)
    host_bytes: int = 0  # host memory the run takes


@dataclass(frozen=True)
class Plan(Document):
    KIND: ClassVar[str] = "atomc.plan"
    OPTIONAL: ClassVar[tuple[str, ...]] = ("host_gap_ms", "host", "recompute_step_ms")

    profile_hash: str
    graph_hash: str  # OpGraph.structure_hash(): codegen retraces and compares
    model_path: str
    config: str | None
    batch_size: int  # micro-batch size the profile was taken with
    options: dict[str, int]
    device: str
    capacity_bytes: int
    reserve_bytes: int
    accum: int  # C: micro-batches each sub-model computes before the next
    accum_fixed: bool  # given by the user (--accum) rather than searched
    activations: str  # "auto", "recompute" or "keep"
    submodels: tuple[Submodel, ...]
    cut_bytes: int  # bytes crossing all cuts, one micro-batch
    predicted_step_ms: float
    predicted_utilisation: float  # GPU compute-busy fraction of the step
    # the C the per-block FLOP/byte argument asks for (docs/design.md, section "Partition:
    # Algorithm 1, exact")
    physical_bound_accum: float
    feasible: bool
    binding: str  # "" when feasible; else the sub-model and constraint that fail
    atomc_version: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    cpu_adam_gbps: float = 0.0  # CPU optimizer throughput assumed (GB/s of fp32 masters)
    search_tier: int = 0  # 0: every constraint; 1: loads may stall; 2: memory only
    # sub-model 1 is loaded for the next step during sub-model 0's update
    early_prefetch: bool = False
    # where cpu_adam_gbps comes from: "given", "measured on this host ..." or a hardware
    # profile's host figure
    cpu_adam_source: str = ""
    # the device copies of weights and gradients ("" in older files: the graph's dtype) and
    # the compute dtype of torch.autocast ("" none); activations are sized for them
    transfer_dtype: str = ""
    autocast: str = ""
    # on a CPU device, the runtime thread's own time before each action it runs, from a
    # calibrated profile (None: not known, taken as 0)
    host_gap_ms: float | None = None
    # host memory by kind and the check against --host-mem (None in files written before it)
    host: HostMemory | None = None
    # activations="auto": the predicted step had every sub-model recomputed its activations
    recompute_step_ms: float | None = None
    # the degrees C weighed for tokens a second (empty: C was given, or the smallest
    # feasible one was asked for with --accum min)
    sweep: tuple[SweepPoint, ...] = ()
    tokens_per_step: int = 0  # C micro-batches' tokens (samples where the model takes no ids)
