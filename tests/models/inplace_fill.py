"""A recurrent model whose output is made empty and then filled in place, step by step, as
people write scans: `out = torch.zeros_like(x)`, then `out[:, t] = cell(x[:, t], h)`. The value
takes a gradient only once the first write lands, so a cut between writes must hand one back.

Configs pick how the fill is written: "loop" (item assignment in a Python loop), "index-put"
(`index_put_` of whole time steps), "scatter" (`scatter_` along time), "new-zeros" and "empty"
(the buffer made by `x.new_zeros` or `torch.empty` instead of `zeros_like`).
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH = 24, 6, 16


class Cell(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.rec = nn.Linear(width, width, bias=False)

    def forward(self, x, h):
        return torch.tanh(self.inp(x) + self.rec(h))


class FilledScan(nn.Module):
    def __init__(self, how: str = "loop"):
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.cells = nn.ModuleList(Cell(WIDTH) for _ in range(SEQ))
        self.head = nn.Linear(WIDTH, VOCAB)

    def buffer(self, x):
        if self.how == "new-zeros":
            return x.new_zeros(x.shape)
        if self.how == "empty":
            return torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return torch.zeros_like(x)

    def forward(self, ids):
        x = self.embed(ids)
        out = self.buffer(x)
        h = x[:, 0] * 0
        for t in range(SEQ):
            h = self.cells[t](x[:, t], h)
            if self.how == "index-put":
                out.index_put_((torch.arange(out.shape[0]), torch.full((out.shape[0],), t)), h)
            elif self.how == "scatter":
                index = torch.full((out.shape[0], 1, WIDTH), t, device=out.device)
                out.scatter_(1, index, h.unsqueeze(1))
            else:
                out[:, t] = h
        return self.head(out)


def build_model(config=None):
    return FilledScan(config or "loop")


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits, batch):
    (ids,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
