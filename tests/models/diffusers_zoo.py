"""Denoisers of the diffusers library, built from tiny configurations (`--config NAME`) as its
own tests build them; nothing is downloaded. Each returns its diffusers output dataclass and is
trained to predict a made-up noise target its inputs decide.

- `unet`: UNet2DConditionModel, the conditional U-Net of Stable Diffusion: ResNet blocks with
  GroupNorm and a timestep embedding, cross-attention to text states, down and up sampling,
  skip connections across the whole model;
- `dit`: DiTTransformer2DModel, the class-conditional diffusion transformer: patch embedding
  with fixed sine-cosine positions, adaLN-Zero modulation from timestep and class embeddings
  (class labels dropped at random while training, for classifier-free guidance).
"""

import diffusers
import torch
import torch.nn.functional as F
from torch import nn

LATENT, CHANNELS, TEXT, TEXT_DIM, STEPS, CLASSES = 8, 4, 6, 16, 1000, 10

CONFIGS = {
    "unet": ("UNet2DConditionModel",
             {"sample_size": LATENT, "in_channels": CHANNELS, "out_channels": CHANNELS,
              "block_out_channels": (8, 16), "layers_per_block": 1, "norm_num_groups": 4,
              "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
              "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
              "cross_attention_dim": TEXT_DIM, "attention_head_dim": 4}),
    "dit": ("DiTTransformer2DModel",
            {"num_attention_heads": 2, "attention_head_dim": 8, "in_channels": CHANNELS,
             "num_layers": 2, "sample_size": LATENT, "patch_size": 2,
             "num_embeds_ada_norm": CLASSES}),
}


def build_model(config=None) -> nn.Module:
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}: give one of {', '.join(CONFIGS)}")
    cls, kwargs = CONFIGS[config]
    return getattr(diffusers, cls)(**kwargs)


def example_inputs(model, batch_size):
    latents = torch.randn(batch_size, CHANNELS, LATENT, LATENT)
    timesteps = torch.randint(0, STEPS, (batch_size,))
    if isinstance(model, diffusers.DiTTransformer2DModel):
        return (latents, timesteps, torch.randint(0, CLASSES, (batch_size,)))
    return (latents, timesteps, torch.randn(batch_size, TEXT, TEXT_DIM))


def loss_fn(outputs, batch):
    latents = batch[0]
    prediction = outputs.sample[:, :CHANNELS]  # a model learning its variance predicts it after
    return F.mse_loss(prediction, torch.tanh(latents.flip(1)))
