"""Layout runner, a swapped stage: the runtime's swap machinery over one stage's sub-model range.

input:  the generated package, the stage's range [a, b) and boundary names, the device, the
        optimizer settings
output: a stage executor with the interface of `stage.ResidentStage`, except that it works on
        all micro-batches of a step at once (`batched`): `forward_all`, `backward_all`, then the
        runner reduces the gradients it exposes (`grad_params`) and calls `update`

What comes from the runtime: the host store (flat master, image and gradient buffers, tied
replicas inside the stage), the per-sub-model AdamW over flat buffers, and the executor's two
device slots with their loads, through its public API (`compute`, `adopt`, `use`, `prefetch`,
`release`, `zero_grads`, `grads_to_host`, `wait_loads`, `update_submodel`; their docstrings give
the stream contract). What is added here, because the runtime's `SwapExecutor.run_step` runs a
whole model step in one call:

- the stage's inputs come from the previous stage and carry gradients back to it;
- a stage that does not hold the model output ends on received output gradients, not a loss;
- gradients stay in the host store until the runner has summed tied weights across stages and
  averaged over the data-parallel group; only then does the optimizer run (in the runtime the
  optimizer starts on a sub-model as soon as its gradients are on the host).

The schedule inside the stage is ATOM's: each sub-model runs over every micro-batch before the
next is loaded; the backward recomputes each sub-model from its boundary inputs, replaying the
RNG state of its forward.

CUDA: `forward_all` and `backward_all` compute on the executor's compute stream (the one its
loads and gradient copies order themselves with), after the caller's stream (received values,
micro-batches, which are marked as used on the compute stream); the caller's stream waits for
them before outputs and gradients go to a Link. Gradient copies to the host run on the offload
stream, overlapping the next sub-model's backward; the host waits for their events before it
reads them. `update` rewrites the images only after every load that reads them is done
(`SwapExecutor.wait_loads`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from atomc.distributed.stage import StageSpec, original_tensor, tensor_attr
from atomc.errors import RuntimeMismatchError
from atomc.runtime.executor import SwapExecutor, rebind_parameters
from atomc.runtime.optim import AdamWConfig, CpuOptimizer
from atomc.runtime.package import SwapPackage
from atomc.runtime.store import HostStore, plan_layouts
from atomc.runtime.trace import Tracer


def restrict(pkg: SwapPackage, spec: StageSpec) -> SwapPackage:
    """The package seen by one stage: sub-models [a, b) renumbered from 0; what it receives
    (and the model inputs it reads) are its inputs; ties only among the stage's own holders."""
    a, b = spec.start, spec.stop
    classes = pkg.classes[a:b]
    read = [n for i in range(a, b) for n in pkg.inputs[i]]
    inputs = tuple(dict.fromkeys([n for n in read if n in spec.recv or n in pkg.model_inputs]))
    tied = {}
    for fqn, holders in pkg.tied.items():
        here = [(i - a, local) for i, local in holders if a <= i < b]
        if len(here) > 1:
            tied[fqn] = here

    def build(device: Any = None) -> list[nn.Module]:
        if device is None:
            return [cls() for cls in classes]
        with torch.device(device):
            return [cls() for cls in classes]

    return SwapPackage(
        path=pkg.path, module=pkg.module, classes=classes, model_inputs=inputs,
        inputs=pkg.inputs[a:b], outputs=pkg.outputs[a:b], boundaries=pkg.boundaries[a:b],
        plan=pkg.plan, param_names=pkg.param_names[a:b], tied=tied, build_submodels=build,
        load_original_state_dict=pkg.load_original_state_dict, export_state_dict=pkg.export_state_dict)


def _rng_state(device: torch.device) -> tuple:
    cpu = torch.get_rng_state()
    gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, gpu


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


class SwappedStage:
    """One stage trained with the swap runtime (see the module docstring)."""

    kind = "swapped"
    batched = True

    def __init__(self, pkg: SwapPackage, spec: StageSpec, device: torch.device,
                 loss_fn: Callable[[Any, tuple], torch.Tensor] | None, opt_cfg: AdamWConfig,
                 dtype: torch.dtype | None = None, seed: int = 0):
        self.full = pkg
        self.spec = spec
        self.device = device
        self.loss_fn = loss_fn
        self.sub = restrict(pkg, spec)
        self.master_dtype = dtype or torch.float32
        self.host_modules = [m.to(self.master_dtype) for m in self.sub.build_submodels()]
        # the runner clips globally and reduces first; the optimizer here only applies updates
        self.opt_cfg = replace(opt_cfg, max_grad_norm=None)
        layouts = plan_layouts(self.sub, self.host_modules, opt_cfg.decay_filter)
        self.store = HostStore(layouts, self.master_dtype, self.master_dtype, pin=device.type == "cuda")
        self._bind_host()
        tracer = Tracer(device, enabled=False)
        self.opt = CpuOptimizer(self.store, self.opt_cfg, None, tracer, threaded=False)
        self.ex = SwapExecutor(self.sub, self.store, self.opt,
                               [dict(m.named_buffers()) for m in self.host_modules], device=device,
                               accum=1, activations="recompute", offload_activations=False,
                               autocast_dtype=None, loss_fn=loss_fn or (lambda o, b: o), seed=seed,
                               tracer=tracer)
        self.k = self.sub.num_submodels
        self._grad_views = self._make_grad_views()
        self.step = 0
        self.num_micro = 1
        self._offloads: list[Any] = []  # events of gradient copies to the host not yet waited for

    # ---- weights -------------------------------------------------------------------------------

    def _bind_host(self) -> None:
        """Host modules whose parameters are views of the masters (export and loads read them)."""
        for i, (mod, L) in enumerate(zip(self.host_modules, self.store.layouts)):
            params = dict(mod.named_parameters())
            with torch.no_grad():
                for e in L.entries:
                    if e.owned:
                        self.store.master_param(i, e).copy_(params[e.local])
            rebind_parameters(mod, {e.local: self.store.master_param(i, e) for e in L.entries},
                              requires_grad=False)
        for i in range(len(self.store.layouts)):
            self.store.refresh_images(i)

    def _make_grad_views(self) -> list[tuple[str, nn.Parameter]]:
        """(FQN, parameter over the master with .grad over the master gradient) per owned weight."""
        out = []
        for i, L in enumerate(self.store.layouts):
            for e in L.entries:
                if not e.owned:
                    continue
                p = nn.Parameter(self.store.master_param(i, e), requires_grad=False)
                p.grad = self.store.grad_master[i][e.owner_offset:e.owner_offset + e.numel].view(e.shape)
                out.append((e.key, p))
        return out

    def load_original(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, L in enumerate(self.store.layouts):
                gi = self.spec.start + i
                names = self.full.param_names[gi]
                for e in L.entries:
                    if e.owned:
                        src = original_tensor(self.full, state_dict, names.get(e.local, e.key))
                        dst = self.store.master_param(i, e)
                        if tuple(src.shape) != tuple(dst.shape):
                            raise RuntimeMismatchError(
                                f"{e.key} has shape {tuple(src.shape)} in the initial state, sub-model "
                                f"{gi} holds {tuple(dst.shape)}; regenerate the package for this model")
                        dst.copy_(src)
                for local, b in self.host_modules[i].named_buffers():
                    fqn = names.get(local)
                    if fqn is not None and fqn in state_dict:
                        b.copy_(state_dict[fqn])
                        tensor_attr(self.ex.module(i), local).copy_(state_dict[fqn])
        self.ex.wait_loads()  # no load still reads the images
        for i in range(self.k):
            self.store.refresh_images(i)

    def after_load(self) -> None:
        self.ex.invalidate_slots()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self._grad_views

    def grad_params(self) -> list[tuple[str, nn.Parameter]]:
        return self._grad_views

    def export(self) -> dict[str, torch.Tensor]:
        return {fqn: p.detach().cpu().clone() for fqn, p in self._grad_views}

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [m.detach().clone() for m in self.store.master],
                "optimizer": self.opt.state_dict(),
                "buffers": [{n: b.detach().cpu().clone() for n, b in self.ex.module(i).named_buffers()}
                            for i in range(self.k)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for i, m in enumerate(state["masters"]):
                if m.shape != self.store.master[i].shape:
                    raise RuntimeMismatchError(f"checkpoint weights of stage sub-model {i} have shape "
                                               f"{tuple(m.shape)}, expected {tuple(self.store.master[i].shape)}")
                self.store.master[i].copy_(m)
            for i, bufs in enumerate(state["buffers"]):
                own = dict(self.ex.module(i).named_buffers())
                for n, b in bufs.items():
                    own[n].copy_(b)
        self.ex.wait_loads()
        for i in range(self.k):
            self.store.refresh_images(i)
        self.opt.load_state_dict(state["optimizer"])
        self.ex.invalidate_slots()

    # ---- a step --------------------------------------------------------------------------------

    def begin_step(self, num_micro: int, step: int) -> None:
        self.num_micro = num_micro
        self.step = step
        for g in self.store.grad:
            g.zero_()
        for g in self.store.grad_master:
            g.zero_()

    def _offload(self, i: int) -> None:
        """Sub-model i's gradients to the host store (asynchronous on CUDA: see _host_grads)."""
        self._offloads.append(self.ex.grads_to_host(i))

    def _host_grads(self) -> None:
        """Wait for the gradient copies issued so far (the host reads store.grad after this)."""
        for ev in self._offloads:
            if ev is not None:
                ev.synchronize()  # this copy only, not the device
        self._offloads = []

    def forward_all(self, received: list[dict[str, Any]], micro: list[tuple]) -> list[Any]:
        """Every micro-batch through the stage, one sub-model at a time. Returns the values to send
        per micro-batch, or (last stage) the losses, whose backward has already run."""
        with self.ex.compute():
            return self._forward_all(received, micro)

    def _forward_all(self, received: list[dict[str, Any]], micro: list[tuple]) -> list[Any]:
        ex, k, M = self.ex, self.k, len(micro)
        self.envs = []
        for b, r in zip(micro, received):
            env = dict(zip(self.full.model_inputs, b))
            env.update(r)
            for v in env.values():
                ex.adopt(v)  # made on the caller's stream, read (and dropped) on the compute stream
            self.envs.append(env)
        self.received = received
        self.rng = [[None] * M for _ in range(k)]
        self.grads: list[dict[str, torch.Tensor]] = [{} for _ in range(M)]
        self._offloads = []
        forward_only = k - 1 if self.spec.holds_output else k
        for i in range(forward_only):
            ex.use(i)
            if i + 1 < k:
                ex.prefetch(i + 1)
            mod = ex.module(i)
            with torch.no_grad():
                for m in range(M):
                    env = self.envs[m]
                    self.rng[i][m] = _rng_state(self.device)
                    outs = mod(*[env[n] for n in self.sub.inputs[i]])
                    outs = outs if isinstance(outs, tuple) else (outs,)
                    env.update(zip(self.sub.outputs[i], outs))
            ex.release(i)
        if not self.spec.holds_output:
            return [{n: env[n] for n in self.spec.send} for env in self.envs]
        # the last sub-model of the model: forward, loss and backward per micro-batch, resident
        i = k - 1
        ex.use(i)
        ex.zero_grads(i)
        mod = ex.module(i)
        losses = []
        for m in range(M):
            env = self.envs[m]
            args = self._leaves(env, i)
            loss = self.loss_fn(mod(*args), micro[m])
            (loss / M).backward()
            self._collect(m, i, args)
            losses.append(loss.detach())
        ex.release(i)
        self._offload(i)
        return losses

    def _leaves(self, env: dict[str, Any], i: int) -> list[Any]:
        args = []
        for n in self.sub.inputs[i]:
            v = env[n]
            if _float(v) and (n not in self.full.model_inputs):
                v = v.detach().requires_grad_(True)
            args.append(v)
        return args

    def _collect(self, m: int, i: int, args: list[Any]) -> None:
        for n, a in zip(self.sub.inputs[i], args):
            if isinstance(a, torch.Tensor) and a.grad is not None:
                g = self.grads[m]
                g[n] = a.grad if n not in g else g[n] + a.grad

    def backward_all(self, out_grads: list[dict[str, torch.Tensor] | None]) -> list[dict[str, Any]]:
        """Backward of every micro-batch, one sub-model at a time in reverse, recomputing each
        from its boundary inputs. Returns the gradients of the received values."""
        with self.ex.compute():
            return self._backward_all(out_grads)

    def _backward_all(self, out_grads: list[dict[str, torch.Tensor] | None]) -> list[dict[str, Any]]:
        ex, k, M = self.ex, self.k, self.num_micro
        if not self.spec.holds_output:
            for m in range(M):
                for n, g in (out_grads[m] or {}).items():
                    self.grads[m][n] = ex.adopt(g)
        top = k - 2 if self.spec.holds_output else k - 1
        for i in range(top, -1, -1):
            ex.use(i)
            if i > 0:
                ex.prefetch(i - 1)
            ex.zero_grads(i)
            mod = ex.module(i)
            for m in range(M):
                g_out = [self.grads[m].pop(n, None) for n in self.sub.outputs[i]]
                if all(g is None for g in g_out):
                    continue
                args = self._leaves(self.envs[m], i)
                saved = _rng_state(self.device)
                _set_rng_state(self.device, self.rng[i][m])
                with torch.enable_grad():
                    outs = mod(*args)
                _set_rng_state(self.device, saved)
                outs = outs if isinstance(outs, tuple) else (outs,)
                pairs = [(o, g) for o, g in zip(outs, g_out)
                         if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                self._collect(m, i, args)
            ex.release(i)
            self._offload(i)
        self._host_grads()
        for i in range(k):
            self.store.reduce_grads(i)  # replicas of tied weights inside the stage into their master
        out = [{n: self.grads[m].get(n) for n in self.spec.recv} for m in range(M)]
        self.envs = []
        self.grads = []
        return out

    def update(self, coef: float | None) -> None:
        """The optimizer on the (reduced) master gradients, then fresh images for the next loads
        (each sub-model's slot loads again before its next use)."""
        for i in range(self.k):
            if coef is not None:
                self.store.grad_master[i].mul_(coef)
            self.ex.update_submodel(i, self.step)

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        self.opt.close()
