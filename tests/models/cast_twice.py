"""A small state-space language model written as Hugging Face's Mamba is: the same parameter
is cast with `.float()` in two places (the recurrence's decay and its skip term), and read as
it is once more. Traced in float32 the casts do nothing, and torch.export records the second
cast, and the plain read, as reads of the first cast; traced in float64 each reads the weight.
A branch on the sequence length keeps symbolic tracing out (torch.export traces it)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, STATE, SEQ = 32, 8, 4, 6


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(DIM, 2 * DIM)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, STATE + 1).float()).repeat(DIM, 1))
        self.D = nn.Parameter(torch.ones(DIM))
        self.out_proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        decay = torch.exp(-torch.exp(self.A_log.float()))  # [DIM, STATE]
        state = torch.zeros(x.shape[0], DIM, STATE, dtype=u.dtype, device=x.device)
        outs = []
        for t in range(x.shape[1]):
            state = state * decay + u[:, t, :, None]
            outs.append(state.sum(-1))
        y = torch.stack(outs, 1)
        skip = self.A_log.float().mean(-1) * self.D  # the weight cast again
        y = y + u * skip + u * self.A_log[:, 0]  # and read as it is
        if x.shape[1] > 1:  # Python control flow on a shape: export traces it, fx does not
            y = y * F.silu(gate)
        return self.out_proj(y)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixers = nn.ModuleList(Mixer() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for mixer in self.mixers:
            h = h + mixer(h)
        return self.head(self.norm(h))


def build_model(config=None):
    return Model()


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits, batch):
    (ids,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
