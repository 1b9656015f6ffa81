"""MegaTrain (github DLYuanGod/MegaTrain, arXiv 2604.05091) driven on a Llama-shaped model of
examples/hf.py at random initialisation, for bench/side_by_side.py. Nothing of MegaTrain is in
this repository: it is imported from a checkout given by `--megatrain DIR` (DIR holds its
`infinity/` package).

    python bench/megatrain_driver.py --megatrain bench/vendor/MegaTrain --config llama-1.3b \
        --batch 4 [--seq-len 2048] [--steps 3] [--dtype bfloat16] [--verify]

**Carrying the checkout to the GPU machine.** The device tool carries ignored paths named in
`carry` (64 MiB in all); `bench/vendor/` is in .gitignore. Here, once (the snapshot the
benchmark was written against is commit 919520f; its repository also holds a copy of verl and
aarch64 build outputs, which the driver needs none of, so only the Python package goes):

    mkdir -p bench/vendor/MegaTrain
    git --git-dir=<fetched mirror of DLYuanGod/MegaTrain> archive HEAD infinity LICENSE README.md \
        | tar -x -C bench/vendor/MegaTrain --exclude='*/build/*' --exclude='*.so' --exclude='*.o'

(about 0.5 MiB; the fetched snapshot lacks some of its large aarch64 build files, which
`git archive` may complain of, outside the paths taken), then name `bench/vendor` in the run's
`carry` and pass
`--megatrain bench/vendor/MegaTrain`. MegaTrain's optional CUDA extensions (`cuda_pipeline`,
`infinity_memory_ops`) are not imported by the path driven here, so nothing is built there. It
needs torch, transformers and pyyaml, which the GPU image has.

**What the driver sets, and why** (by configuration and one documented override; MegaTrain's
files are not edited):

1. The model: `AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
   dtype=DTYPE)` with the benchmark's random weights loaded (examples/hf.py's state dict, the
   `model.` prefix of its wrapper removed). MegaTrain's own training script loads the model in
   its `config.dtype` on the host, so its host master weights are bfloat16 and its optimizer
   updates bfloat16 parameters; it cannot keep float32 masters with bfloat16 compute (its GPU
   layer templates are `deepcopy(host_layer).to(device)`, so float32 host layers compute in
   float32, and its bfloat16 gradient slabs cannot be assigned to float32 `.grad`). The row
   says so beside the others' float32 masters.
2. `CPUMasterConfig(dtype=DTYPE, attn_implementation="sdpa", batch_size=B, max_seq_len=T,
   dataset_name=...)`: `__post_init__` refuses a config without a dataset, which
   `CPUMasterModel` never reads (the driver feeds token batches itself); `attn_implementation`
   there is only validated: what the layers run is the HF model's
   `config._attn_implementation`, which `_preserve_attn_implementation` copies onto its GPU
   layer templates. `checkpoint_interval` (4) and `num_grad_slabs` (12) keep MegaTrain's
   defaults.
3. **The mask.** `_forward_and_backward_single_gpu` passes the batch's 2-D `[B, T]` padding
   mask, moved to the GPU, into every decoder layer as `attention_mask`
   (`_build_layer_kwargs`). flash-attn 2 reads that as a padding mask and applies causality
   itself; flash-attn cannot be installed on the GPU machine. transformers' SDPA path
   (`sdpa_attention_forward`) sets `is_causal` only when `attention_mask is None`, and hands a
   2-D mask to `torch.nn.functional.scaled_dot_product_attention` as `attn_mask`: an integer
   mask (what MegaTrain's `collate_fn` makes) raises "Expected attn_mask dtype to be bool or
   float", and a boolean one would broadcast over the query rows, i.e. attention with no causal
   mask. On unpadded batches the only mask is the causal one, which SDPA applies with
   `is_causal=True` when the mask is None. So `SDPAMegaTrain` overrides `_build_layer_kwargs`
   to pass `attention_mask=None` (and nothing else), and the driver feeds unpadded batches with
   an all-ones mask (`forward_and_backward` calls `.to(device)` on it). `--verify` checks the
   result against the plain transformers model: loss and every gradient on one batch.
4. The step is what MegaTrain's `examples/sft/train.py` does per step, without gradient
   clipping (no contender clips): `forward_and_backward(ids, ones, labels=ids)` (it shifts the
   labels itself; the loss is the mean next-token cross-entropy, as examples/hf.py's), then
   `optimizer.step()`, `_sync_params_to_gpu()`, `zero_grad()`. The optimizer is its script's
   choice: DeepSpeed's CPU Adam where deepspeed imports and its op builds, else
   `torch.optim.AdamW` (fused on the CPU when this torch has it, which only makes it faster
   than the script's default); the row names which, and why.
5. Tokens per weight pass: MegaTrain streams every layer three times per step (forward,
   recompute, backward) for the whole batch at once, so the benchmark's C micro-batches of
   `micro_batch` rows are one batch of `C x micro_batch` rows here.

Without CUDA (MegaTrain allocates CUDA streams and events in its constructor) or without the
checkout, `unavailable()` says why and nothing runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _examples_on_path() -> None:
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))


class MegaTrainUnavailable(Exception):
    """Why MegaTrain cannot run here (one line)."""


def unavailable(megatrain_dir: str | None, device: torch.device) -> str | None:
    """Why MegaTrain cannot run on `device` from `megatrain_dir`, or None when it can."""
    if device.type != "cuda":
        return (f"MegaTrain runs on CUDA only (its CPUMasterModel creates CUDA streams and "
                f"events); the device is {device}")
    if not megatrain_dir:
        return ("no MegaTrain checkout: give --megatrain DIR (DIR holding its infinity/ package; "
                "see bench/megatrain_driver.py for carrying one to the GPU machine)")
    if not (Path(megatrain_dir) / "infinity" / "model" / "cpu_master.py").is_file():
        return (f"--megatrain {megatrain_dir}: no infinity/model/cpu_master.py there; expected a "
                f"checkout of github DLYuanGod/MegaTrain")
    return None


def load_infinity(megatrain_dir: str | Path):
    """MegaTrain's `infinity` package from the checkout at `megatrain_dir`."""
    path = str(Path(megatrain_dir).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        infinity = importlib.import_module("infinity")
    except ImportError as e:
        raise MegaTrainUnavailable(f"importing MegaTrain's infinity package from {path} failed: "
                                   f"{e}") from None
    # its modules log every buffer they allocate at INFO; the benchmark prints its own lines
    logging.getLogger("infinity").setLevel(logging.WARNING)
    return infinity


def sdpa_model_class(infinity):
    """CPUMasterModel with the decoder layers' mask left to SDPA's is_causal (see 3. above)."""

    class SDPAMegaTrain(infinity.CPUMasterModel):
        def _build_layer_kwargs(self, mask, cache_position, position_ids, position_embeddings):
            kwargs = super()._build_layer_kwargs(mask, cache_position, position_ids,
                                                 position_embeddings)
            kwargs["attention_mask"] = None  # unpadded batches: causal only, SDPA's is_causal
            return kwargs

    return SDPAMegaTrain


def hf_model(config_name: str, state_dict: dict[str, torch.Tensor] | None, dtype: torch.dtype):
    """The transformers model of examples/hf.py's `config_name` with SDPA attention, in `dtype`
    on the host, with `state_dict` (examples/hf.py's keys) loaded."""
    _examples_on_path()
    import hf
    from transformers import AutoModelForCausalLM

    cfg, _ = hf.load_config(config_name)
    # built on the GPU where there is one (its random initialisation of billions of weights is
    # minutes faster than the host's), then moved to the host, where MegaTrain wants it
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    if state_dict is not None:
        inner = {k.removeprefix("model."): v for k, v in state_dict.items()}
        model.load_state_dict(inner)
    model = model.cpu()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model.train()


def make_optimizer(params: list[torch.nn.Parameter], lr: float) -> tuple[Any, str]:
    """MegaTrain's script's optimizer: DeepSpeed's CPU Adam when it imports (it compiles at
    first use), else torch's AdamW, as its script falls back; the name says which, and why."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, adamw_mode=True), "DeepSpeedCPUAdam"
    except ImportError:
        why = "deepspeed not installed"
    except Exception as e:  # noqa: BLE001 - its build at first use fails in many ways; named
        why = f"DeepSpeedCPUAdam failed: {type(e).__name__}: {str(e).strip()[:120]}"
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True), f"torch AdamW, fused ({why})"
    except (RuntimeError, TypeError):  # a torch without the fused CPU kernel for this dtype
        return torch.optim.AdamW(params, lr=lr, foreach=True), f"torch AdamW, foreach ({why})"


class MegaTrainRun:
    """One MegaTrain model and optimizer; `step(batch)` trains on a [B, T] batch of token ids."""

    def __init__(self, megatrain_dir: str | Path, config_name: str,
                 state_dict: dict[str, torch.Tensor] | None, *, batch_size: int, seq_len: int,
                 dtype: torch.dtype = torch.bfloat16, device_index: int = 0, lr: float = 1e-4):
        infinity = load_infinity(megatrain_dir)
        model = hf_model(config_name, state_dict, dtype)
        self.config = infinity.CPUMasterConfig(
            model_name=config_name, device=device_index, dtype=dtype,
            attn_implementation="sdpa", batch_size=batch_size, max_seq_len=seq_len,
            dataset_name="random-tokens (fed by bench/megatrain_driver.py)", learning_rate=lr)
        self.model = sdpa_model_class(infinity)(model, self.config)
        del model
        self.optimizer, self.optimizer_name = make_optimizer(self.model.get_parameters(), lr)
        self.num_params = sum(p.numel() for p in self.model.get_parameters())

    def step(self, batch: torch.Tensor) -> float:
        ids = batch.cpu()
        loss, _tokens, _timing = self.model.forward_and_backward(ids, torch.ones_like(ids), ids)
        self.optimizer.step()
        self.model._sync_params_to_gpu()
        self.model.zero_grad()
        self.optimizer.zero_grad()
        return float(loss)

    def close(self) -> None:
        """Stop MegaTrain's gradient thread and free its GPU buffers for the next contender."""
        self.model.cleanup()
        self.model.release_gpu_buffers()


def verify_against_hf(megatrain_dir: str | Path, config_name: str = "tiny-llama",
                      batch_size: int = 2, seq_len: int = 16) -> dict[str, float]:
    """One batch through MegaTrain (as driven here) and through the plain transformers model, in
    float32 without TF32: the losses and the largest gradient difference over the largest
    gradient. A wrong mask (no causality) changes both far beyond rounding."""
    _examples_on_path()
    import hf

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            reference = hf.build_model(config_name, seq_len)
        state = {k: v.clone() for k, v in reference.state_dict().items()}
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, reference.vocab_size, (batch_size, seq_len), generator=g)
        plain = hf_model(config_name, state, torch.float32).cuda()
        on = ids.cuda()
        loss_ref = hf.loss_fn(plain(input_ids=on, use_cache=False).logits, (on,))
        loss_ref.backward()
        grads_ref = {k: p.grad.detach().cpu() for k, p in plain.named_parameters()}
        del plain
        run = MegaTrainRun(megatrain_dir, config_name, state, batch_size=batch_size,
                           seq_len=seq_len, dtype=torch.float32)
        try:
            loss, _, _ = run.model.forward_and_backward(ids, torch.ones_like(ids), ids)
            names = _megatrain_names(run)
            worst = 0.0
            scale = max(float(g.abs().max()) for g in grads_ref.values())
            for name, ref in grads_ref.items():
                p = names.get(name)
                if p is None or p.grad is None:
                    raise AssertionError(f"MegaTrain produced no gradient for {name}")
                worst = max(worst, float((p.grad.float() - ref).abs().max()))
        finally:
            run.close()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return {"loss_megatrain": float(loss), "loss_transformers": float(loss_ref),
            "max_grad_diff_over_max_grad": worst / scale}


def agrees(check: dict[str, float], loss_rel: float = 1e-4, grad_rel: float = 1e-3) -> bool:
    """Whether verify_against_hf's figures are float32 rounding (a mask without causality is
    off by orders of magnitude more)."""
    loss_ok = abs(check["loss_megatrain"] - check["loss_transformers"]) <= (
        loss_rel * abs(check["loss_transformers"]))
    return loss_ok and check["max_grad_diff_over_max_grad"] <= grad_rel


def _megatrain_names(run: MegaTrainRun) -> dict[str, torch.nn.Parameter]:
    """transformers' parameter names -> MegaTrain's host parameters (the same modules)."""
    m = run.model
    out: dict[str, torch.nn.Parameter] = {}
    for n, p in m.embedding.named_parameters():
        out[f"model.embed_tokens.{n}"] = p
    for i, layer in enumerate(m.cpu_layers):
        for n, p in layer.named_parameters():
            out[f"model.layers.{i}.{n}"] = p
    if m.norm is not None:
        for n, p in m.norm.named_parameters():
            out[f"model.norm.{n}"] = p
    for n, p in m.lm_head.named_parameters():
        out[f"lm_head.{n}"] = p
    return out


def main(argv: list[str] | None = None) -> int:
    import statistics
    import time

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatrain", required=True, help="checkout holding MegaTrain's infinity/")
    ap.add_argument("--config", default="llama-1.3b", help="a preset of examples/hf.py")
    ap.add_argument("--batch", type=int, default=4, help="rows per step (one weight pass)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--verify", action="store_true",
                    help="first compare loss and gradients with transformers on tiny-llama")
    args = ap.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    why = unavailable(args.megatrain, device)
    if why:
        print(f"megatrain_driver: {why}")
        return 2 if device.type == "cuda" else 0
    try:
        if args.verify:
            print("verify:", verify_against_hf(args.megatrain))
        run = MegaTrainRun(args.megatrain, args.config, None, batch_size=args.batch,
                           seq_len=args.seq_len, dtype=getattr(torch, args.dtype))
    except MegaTrainUnavailable as e:
        print(f"megatrain_driver: {e}")
        return 2
    try:
        g = torch.Generator().manual_seed(0)
        vocab = run.model.vocab_size
        times = []
        for s in range(args.warmup + args.steps):
            batch = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = run.step(batch)
            torch.cuda.synchronize()
            if s >= args.warmup:
                times.append(time.perf_counter() - t0)
            print(f"step {s}: loss {loss:.4f}, {time.perf_counter() - t0:.3f} s")
        step_s = statistics.median(times)
        tokens = args.batch * args.seq_len
        print(f"MegaTrain {args.config} ({run.num_params / 1e9:.2f}B, {args.dtype}, "
              f"{run.optimizer_name}): {tokens / step_s:,.0f} tokens/s, "
              f"{6 * run.num_params * tokens / step_s / 1e12:.1f} model TFLOPS")
    finally:
        run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
