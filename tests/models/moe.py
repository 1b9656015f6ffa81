"""A small mixture-of-experts language model written the way Hugging Face's MoE families are:

- the router counts tokens per expert with `histc`, on float32 on a CPU and int32 elsewhere
  (a branch on the device type: a meta-device trace must still take the CPU's branch when
  the model will run on a CPU, which has no int32 histc);
- the counts feed router statistics that carry no gradient (`cumsum` to int32 offsets);
- attention masks with `torch.finfo(scores.dtype).min`, which must follow the dtype the
  scores have at run time (bfloat16 under autocast overflows on float32's);
- each block adds its residual in place (`h += x`, as Hugging Face's ResNet and Falcon do),
  so a sub-model may receive a tensor it writes;
- a frozen position embedding (`requires_grad_(False)`, as Whisper's encoder has), which
  training must leave as it is.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, EXPERTS, TOP, SEQ = 64, 16, 4, 2, 8


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x):
        weights, chosen = self.router(x).softmax(-1).topk(TOP, dim=-1)
        count_dtype = torch.float32 if x.device.type in ("cpu", "mps") else torch.int32
        counts = torch.histc(chosen.reshape(-1).to(count_dtype), bins=EXPERTS, min=0,
                             max=EXPERTS - 1)
        offsets = counts.cumsum(0, dtype=torch.int32)
        balance = offsets[-1].float() / (counts.float().max() * EXPERTS)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            gate = (weights * (chosen == e)).sum(-1, keepdim=True)
            out = out + gate * expert(x)
        return out * balance


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.moe = MoE()

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / DIM ** 0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        h = scores.softmax(-1) @ v
        h += x
        out = self.moe(self.norm2(h))
        out += h
        return out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.positions = nn.Embedding(SEQ, DIM).requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.embed(ids) + self.positions.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(config=None):
    return Model()


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits, batch):
    (ids,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
