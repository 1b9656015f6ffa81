"""A model.py in the style of Meta's llama reference code: rotary embeddings as complex
frequencies (`torch.polar`, `view_as_complex`), kept as a plain attribute rather than a buffer,
and an RMSNorm that calls `x.float()` twice (a no-op cast torch.export aliases in float32)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 8


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[None, :, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x, freqs_cis):
        B, L, _ = x.shape
        q, k, v = (w(x).view(B, L, HEADS, -1) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(2, 3) / math.sqrt(DIM // HEADS)
        mask = torch.full((L, L), float("-inf"), device=x.device).triu(1)
        out = F.softmax(scores.float() + mask, dim=-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).reshape(B, L, DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.w1, self.w3 = nn.Linear(DIM, 64, bias=False), nn.Linear(DIM, 64, bias=False)
        self.w2 = nn.Linear(64, DIM, bias=False)

    def forward(self, h, freqs_cis):
        h = h + self.attention(self.attention_norm(h), freqs_cis)
        x = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(x)) * self.w3(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.freqs_cis = precompute_freqs_cis(DIM // HEADS, SEQ * 2)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]].to(h.device)
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


def build_model(config=None):
    return Transformer()


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits, batch):
    (ids,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
