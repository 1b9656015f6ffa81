"""A selective state-space scan written as Mamba's reference path writes it: the residual
stream is kept in float32 whatever the weights are (`.to(torch.float32)`), the scan upcasts
with `.float()` and casts back to the input's dtype before each matmul with the weights'
values. In float64 the float32 values promote where they meet float64 ones."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, STATE = 32, 4, 16, 4


class ScanBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.in_proj = nn.Linear(WIDTH, 2 * WIDTH)
        self.A_log = nn.Parameter(torch.randn(WIDTH, STATE) * 0.1)
        self.to_b = nn.Linear(WIDTH, STATE, bias=False)
        self.to_c = nn.Linear(WIDTH, STATE, bias=False)
        self.out_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, residual):
        residual = (h + residual).to(torch.float32)
        x = self.norm(residual.to(self.norm.weight.dtype))
        u, z = self.in_proj(x).chunk(2, dim=-1)
        input_dtype = u.dtype
        a = -torch.exp(self.A_log.float())
        b, c = self.to_b(u), self.to_c(u)
        decay = torch.exp(a[None, None] * u[..., None])
        drive = b[:, :, None, :].float() * u[..., None]
        state = torch.zeros(u.shape[0], WIDTH, STATE, dtype=input_dtype, device=u.device)
        ys = []
        for t in range(SEQ):
            state = decay[:, t] * state + drive[:, t]
            ys.append(torch.matmul(state.to(input_dtype), c[:, t, :, None])[..., 0])
        y = torch.stack(ys, dim=1) * F.silu(z)
        return self.out_proj(y), residual


class ScanLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(ScanBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        residual = torch.zeros_like(h)
        for block in self.blocks:
            h, residual = block(h, residual)
        return self.head(h + residual.to(h.dtype))


def build_model(config=None):
    return ScanLM()


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits, batch):
    (ids,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
