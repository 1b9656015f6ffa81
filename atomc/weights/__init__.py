"""Pretrained weights in and out of the swap runtime (docs/checkpoints.md).

- `read`: a checkpoint on disk (safetensors, single or sharded with its index; PyTorch
  `.bin`/`.pt` state dicts) -> a trainer's host store, tensor by tensor
  (`SwapTrainer.from_package(..., weights=PATH)`, `atomc train --weights PATH`);
- `write`: a trainer's weights -> a directory transformers, peft or safetensors load
  (`trainer.save_pretrained(DIR)`, `atomc export`);
- `names`: which name a file gives each weight of a generated package (the original model's,
  the transformers model's inside it, or peft's for an adapter).
"""

from atomc.weights.names import ModelNames, package_names
from atomc.weights.read import CheckpointFiles, WeightsIn, open_weights
from atomc.weights.write import save_pretrained, tied_names

__all__ = ["CheckpointFiles", "ModelNames", "WeightsIn", "open_weights", "package_names",
           "save_pretrained", "tied_names"]
