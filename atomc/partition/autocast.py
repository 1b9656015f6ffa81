"""Partition stage, autocast: the dtype of every value when a traced graph runs under
torch.autocast on a GPU, with weights on the device in a transfer dtype.

The planner sizes activations, boundaries and checkpoints from these dtypes. The graph was
traced in the model's dtype; what changes under autocast is decided op by op, as CUDA autocast
decides it (torch/include/ATen/autocast_mode.h; tests/partition/test_precision.py checks these lists
against the installed header):

- LOWER ops (matmuls, convolutions, attention) compute in the autocast dtype;
- FP32 ops (norms, softmax, exp/log, losses, reductions that accumulate) compute in float32;
- batch norm (on no list) keeps its input's dtype, whatever its weights' dtype;
- every other op computes in the widest floating dtype of its inputs (torch's type
  promotion), which is also what autocast's PROMOTE list does;
- a constant dtype argument (`.float()`, `.to(torch.float32)`, `softmax(..., dtype=)`) fixes
  the output's dtype; a cast to a dtype read from a value (`x.to(y.dtype)` in an fx trace)
  keeps its traced dtype where it changed it.

Autocast only touches float32, float16 and bfloat16 tensors; float64 stays float64. CPU
autocast has other lists (layer_norm runs in the lower dtype there), so a plan's bytes are a
GPU run's.
"""

from __future__ import annotations

from atomc.ir import OpGraph, OpNode
from atomc.units import FLOAT_BYTES

LOWER = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
})
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    # run in float32 unless the call names an output dtype (the header's SET_OPT_DTYPE list)
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum",
    # redispatched to float32 under another signature
    "norm",
})
# functional and Python spellings that reach the ops above
_SPELLINGS = {
    "__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow",
    "cross_entropy": "log_softmax",
    "interpolate": "upsample_nearest2d", "upsample": "upsample_nearest2d",
    "normalize": "norm", "_softmax": "softmax", "_log_softmax": "log_softmax",
}
# torch.nn leaf modules by class name: the op their forward calls
_MODULES = {
    "Linear": "linear", "LazyLinear": "linear", "Bilinear": "bilinear",
    "Conv1d": "conv1d", "Conv2d": "conv2d", "Conv3d": "conv3d",
    "ConvTranspose1d": "conv_transpose1d", "ConvTranspose2d": "conv_transpose2d",
    "ConvTranspose3d": "conv_transpose3d", "PReLU": "prelu",
    "LSTMCell": "lstm_cell", "GRUCell": "gru_cell", "RNNCell": "rnn_tanh_cell",
    "LayerNorm": "layer_norm", "GroupNorm": "group_norm", "RMSNorm": "rms_norm",
    "Softmax": "softmax", "LogSoftmax": "log_softmax", "Softmin": "softmax",
    "Softplus": "softplus", "CosineSimilarity": "cosine_similarity",
    "PairwiseDistance": "norm", "Upsample": "upsample_nearest2d",
    "UpsamplingNearest2d": "upsample_nearest2d", "UpsamplingBilinear2d": "upsample_bilinear2d",
    "CrossEntropyLoss": "log_softmax", "NLLLoss": "nll_loss", "MSELoss": "mse_loss",
    "L1Loss": "l1_loss", "SmoothL1Loss": "smooth_l1_loss", "HuberLoss": "huber_loss",
    "KLDivLoss": "kl_div", "BCEWithLogitsLoss": "binary_cross_entropy_with_logits",
    **{f"{kind}{d}": name for kind, name in (("BatchNorm", "batch_norm"),
                                               ("LazyBatchNorm", "batch_norm"),
                                               ("InstanceNorm", "instance_norm"),
                                               ("LazyInstanceNorm", "instance_norm"))
       for d in ("1d", "2d", "3d")},
    "SyncBatchNorm": "batch_norm",
}
# Batch norm is on no autocast list, and its kernels take a half input with float32 weights:
# the normalised output keeps the input's dtype; the statistics it returns stay float32.
FOLLOW_INPUT = frozenset({
    "batch_norm", "instance_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "_batch_norm_with_update", "_batch_norm_no_update", "cudnn_batch_norm", "miopen_batch_norm",
})
_CASTS = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16"}
_ELIGIBLE = ("float32", "float16", "bfloat16")


def op_name(node: OpNode) -> str:
    """The op a node runs, as the autocast lists name it: `linear` for torch.nn.Linear,
    torch.nn.functional.linear and aten.linear.default alike."""
    if node.op == "call_module":
        return _MODULES.get(node.module_type, "")
    target = node.target
    if target.startswith("torch.ops."):  # torch.ops.aten.NAME.overload
        parts = target.split(".")
        name = parts[3] if len(parts) > 3 else parts[-1]
    else:
        name = target.rsplit(".", 1)[-1]
    return _SPELLINGS.get(name, name)


def promote(dtypes) -> str:
    """The widest floating dtype of `dtypes` ("" when there is none). float16 with bfloat16
    promotes to float32, as torch does."""
    floats = {d for d in dtypes if d in FLOAT_BYTES}
    if not floats:
        return ""
    if floats == {"float16", "bfloat16"}:
        return "float32"
    return max(floats, key=lambda d: FLOAT_BYTES[d])


def device_dtypes(graph: OpGraph, param_dtypes: dict[str, str],
                  autocast: str) -> list[tuple[str, ...]]:
    """Every node's output dtypes on the device, in graph order.

    `param_dtypes` maps each parameter FQN to its dtype on the device; buffers and the model's
    inputs keep their traced dtypes. `autocast` is the autocast dtype ("" for none: only the
    parameters' dtypes propagate).
    """
    out: dict[str, tuple[str, ...]] = {}
    traced: dict[str, tuple[str, ...]] = {}
    scalar: dict[str, tuple[bool, ...]] = {}  # 0-dim values: promotion ranks them lower
    for node in graph.nodes:
        was = tuple(o.dtype for o in node.outputs)
        traced[node.name] = was
        scalar[node.name] = tuple(not o.shape for o in node.outputs)
        if node.op == "get_attr":
            fqn = node.param_fqns[0] if node.param_fqns else ""
            out[node.name] = tuple(param_dtypes.get(fqn, d) for d in was)
            continue
        if node.op in ("placeholder", "output") or not any(d in FLOAT_BYTES for d in was):
            out[node.name] = was
            continue
        inputs = [(d, z) for src in node.inputs for d, z in zip(out[src], scalar[src])]
        if node.op == "call_module":
            inputs += [(param_dtypes.get(f, ""), False) for f in node.param_fqns]
            inputs += [(graph.buffers[f].dtype, False) for f in node.buffer_fqns
                       if f in graph.buffers]
        if op_name(node) in FOLLOW_INPUT and node.inputs and out[node.inputs[0]][0] in FLOAT_BYTES:
            first = out[node.inputs[0]][0]
            stats = "float64" if first == "float64" else "float32"
            out[node.name] = tuple((first if j == 0 else stats) if d in FLOAT_BYTES else d
                                   for j, d in enumerate(was))
            continue
        before = promote_values([(d, z) for src in node.inputs
                                 for d, z in zip(traced[src], scalar[src])])
        out[node.name] = tuple(_result(node, d, inputs, before, autocast) if d in FLOAT_BYTES else d
                               for d in was)
    return [out[n.name] for n in graph.nodes]


def promote_values(values: list[tuple[str, bool]]) -> str:
    """torch's result dtype over (dtype, is 0-dim) floating values: tensors with dimensions
    decide, 0-dim tensors only when there are none."""
    return promote(d for d, z in values if not z) or promote(d for d, _ in values)


def _result(node: OpNode, was: str, inputs: list[tuple[str, bool]], before: str,
            autocast: str) -> str:
    """The dtype of one floating output that was `was` in the trace (`before`: its inputs'
    promoted dtype in the trace)."""
    name = op_name(node)
    if node.op == "call_method" and name in _CASTS:
        return _CASTS[name]
    if node.cast_to == was:
        return was  # a constant dtype in the graph (`.to(torch.float32)`): it holds on the device
    if before and was != before and name in ("to", "type", "_to_copy", "to_copy"):
        return was  # a cast to a dtype taken from a value, which changed the traced dtype
    if name == "type_as" and len(inputs) >= 2:
        return promote([inputs[-1][0]]) or was
    now = promote_values(inputs)
    if not now:
        return was  # made from integers or sizes (arange, a float mask): as traced
    eligible = autocast and all(d in _ELIGIBLE for d, _ in inputs if d in FLOAT_BYTES)
    if eligible and name in LOWER:
        return autocast
    if eligible and name in FP32:
        return "float32"
    return now
