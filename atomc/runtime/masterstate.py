"""Runtime, the masters in a checkpoint: the host store's master weights as a trainer's state
holds them (`checkpoint_masters`), checked against a store (`check_checkpoint_masters`) and
loaded into it (`load_checkpoint_masters`).

A sub-model whose states are on disk is saved as its record's files, hard-linked beside the
run's, with the parts of its masters the store keeps on the host (HostStore.host_parts); a
split store's masters as its bfloat16 images and int16 residuals, with no float32 copy made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from atomc.runtime.store import HostStore


def checkpoint_masters(store: HostStore, copy: bool,
                       target: Path | None = None) -> dict[str, Any]:
    """The masters as a checkpoint holds them: per sub-model, its owned masters (copies
    with `copy`, else views where the store keeps them whole), or, from a split store
    without `copy`, its image and residual as they are (no float32 copy of the model at
    save time); a sub-model whose states are on disk: its record's files, hard-linked
    beside the run's under `target`'s name (the optimizer's state leaves its moments
    out: they are in the record), with the parts of its masters kept on the host
    (`host_parts`)."""
    out: list[Any] = []
    links = store.tier.files.link(target) if store.tier is not None and target else None
    for i in range(len(store.layouts)):
        if store.on_disk(i) and links is not None:
            out.append({"record": links[i], "kinds": sorted(store.disk_kinds[i]),
                        **store.host_parts(i)})
        elif store.mode == "split" and not copy and not store.on_disk(i):
            out.append({"image": store.image[i], "residual": store.residual[i]})
        else:
            master = store.read_master(i)
            view = store.mode != "split" and not store.on_disk(i)  # read_master's own buffer
            out.append(master.clone() if copy and view else master)
    return {"masters": out}


def check_checkpoint_masters(store: HostStore, state: dict[str, Any]) -> str:
    """What is wrong with a checkpoint's masters for this store, or ""."""
    masters = state["masters"]
    if len(masters) != len(store.layouts):
        return f"it has masters of {len(masters)} sub-models, expected {len(store.layouts)}"
    for i, (m, L) in enumerate(zip(masters, store.layouts)):
        if isinstance(m, dict) and "record" in m:
            if not store.on_disk(i) or sorted(store.disk_kinds[i]) != m.get("kinds"):
                here = ", ".join(sorted(store.disk_kinds[i])) or "none"
                return (f"sub-model {i}'s {', '.join(m.get('kinds') or [])} are on disk in "
                        f"it, and this run keeps {here} there; resume with the plan it "
                        f"was written with")
            missing = [f for f in m["record"] if not Path(f).is_file()]
            if missing:
                return (f"sub-model {i}'s state file {missing[0]} is gone; the checkpoint's "
                        f"files on the offload drives must stay with it")
            for name, t in store.host_parts(i).items():
                saved = m.get(name)
                if not isinstance(saved, torch.Tensor) or saved.shape != t.shape:
                    return f"the {name} of sub-model {i} is missing or has another size"
        elif isinstance(m, dict):
            if store.mode != "split" or store.on_disk(i):
                return ("its masters are bfloat16 images with their residuals (a run with "
                        "--transfer-dtype bfloat16, on the host); resume with that run's "
                        "settings")
            image, residual = m.get("image"), m.get("residual")
            if (not isinstance(image, torch.Tensor) or not isinstance(residual, torch.Tensor)
                    or image.shape != store.image[i].shape
                    or residual.shape != store.residual[i].shape):
                return f"the image or residual of sub-model {i} has another size"
        elif not isinstance(m, torch.Tensor) or tuple(m.shape) != (L.owned_numel,):
            return (f"master weights of sub-model {i} have shape "
                    f"{getattr(m, 'shape', None)}, expected ({L.owned_numel},)")
    return ""


def load_checkpoint_masters(store: HostStore, state: dict[str, Any]) -> None:
    """Set the masters from a checkpoint's (check_checkpoint_masters first), then every
    replica of them."""
    for i, m in enumerate(state["masters"]):
        if isinstance(m, dict) and "record" in m:
            assert store.tier is not None
            store.tier.files.adopt(i, m["record"])
            store.tier.version[i] += 1
            for name, t in store.host_parts(i).items():
                t.copy_(m[name])
            if store.mode == "separate" and "images" not in store.disk_kinds[i]:
                store.refresh_images(i)
        elif isinstance(m, dict):
            store.image[i].copy_(m["image"])
            store.residual[i].copy_(m["residual"])
        else:
            store.write_master(i, m)
    for i in range(len(store.layouts)):
        store.refresh_replicas(i)
