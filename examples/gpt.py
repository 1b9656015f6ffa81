"""A GPT in the style of minGPT, with the GPT-3 configurations of ATOM's Table II.

Model-file contract (see README): `build_model(config, seq_len=...)`, `example_inputs(model,
batch_size, seq_len=...)` and `loss_fn(outputs, batch)`.

Layer counts come from the GPT-3 paper (Brown et al. 2020, Table 2.1); widths and heads from
ATOM's Table II. GPT-3 XL is listed with 24 heads, which does not divide d_model = 2048 (the
GPT-3 paper's own d_head = 128 would mean 16): we use 16 heads. The head count does not change
the parameter count. Input and output embeddings are tied, as in GPT-2/GPT-3.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int = 50257
    seq_len: int = 2048
    dropout: float = 0.0
    tied: bool = True  # the LM head shares the token embedding (GPT-2/GPT-3)


CONFIGS = {
    "gpt3-small": GPTConfig(12, 768, 12),
    "gpt3-medium": GPTConfig(24, 1024, 16),
    "gpt3-large": GPTConfig(24, 1536, 16),
    "gpt3-xl": GPTConfig(24, 2048, 16),
    "gpt3-2.7b": GPTConfig(32, 2560, 32),
    "gpt3-6.7b": GPTConfig(32, 4096, 32),
    "gpt3-13b": GPTConfig(40, 5120, 40),
    "gpt3-175b": GPTConfig(96, 12288, 96),
    # small ones for tests and the CPU demo; byte-level vocabulary
    "tiny": GPTConfig(2, 32, 4, vocab_size=256, seq_len=16),
    "tiny-dropout": GPTConfig(2, 32, 4, vocab_size=256, seq_len=16, dropout=0.1),
    # untied LM head: SWARM stages average within a stage, so no weight may span two stages
    "tiny-untied": GPTConfig(2, 32, 4, vocab_size=256, seq_len=16, dropout=0.1, tied=False),
    "mini-untied": GPTConfig(4, 128, 4, vocab_size=256, seq_len=64, tied=False),
    "mini": GPTConfig(4, 128, 4, vocab_size=256, seq_len=64),
    "demo": GPTConfig(6, 256, 8, vocab_size=256, seq_len=128, dropout=0.1),
}
# Nominal sizes, for the parameter-count check in the tests.
NOMINAL_PARAMS = {
    "gpt3-small": 125e6,
    "gpt3-medium": 350e6,
    "gpt3-large": 760e6,
    "gpt3-xl": 1.3e9,
    "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13e9,
    "gpt3-175b": 175e9,
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.d_model = cfg.d_model
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        head_dim = width // self.n_head
        q = q.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.wte.weight  # tied input/output embedding
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(config: str | None = None, seq_len: int | None = None) -> nn.Module:
    name = config or "tiny"
    if name not in CONFIGS:
        raise ValueError(f"unknown GPT config {name!r}; choose one of {', '.join(CONFIGS)}")
    cfg = CONFIGS[name]
    if seq_len is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq_len)
    return GPT(cfg)


def example_inputs(model: GPT, batch_size: int, seq_len: int | None = None) -> tuple[torch.Tensor]:
    seq = seq_len or model.cfg.seq_len
    return (torch.randint(0, model.cfg.vocab_size, (batch_size, seq)),)


def loss_fn(logits: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    """Next-token loss: the batch is the input tokens; targets are the tokens shifted by one."""
    (idx,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
