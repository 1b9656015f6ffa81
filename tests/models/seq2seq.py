"""A translation model of torch.nn.Transformer: encoder and decoder stacks, a causal mask from
generate_square_subsequent_mask, source and target embeddings, two integer inputs. No dropout:
its swap-trainer check once failed at the first loss (0.01% apart) in a clean-clone run on a
loaded box and never again in isolation; dropout is covered by the nanoGPT and BERT cases."""

import torch
import torch.nn.functional as F
from torch import nn

SRC, TGT, VOCAB = 10, 8, 30


class Translator(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.src_embed = nn.Embedding(VOCAB, d)
        self.tgt_embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(1, max(SRC, TGT), d) * 0.02)
        self.core = nn.Transformer(d, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                                   dim_feedforward=64, dropout=0.0, batch_first=True,
                                   norm_first=True)
        self.out = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(TGT),
                             persistent=False)

    def forward(self, src, tgt):
        s = self.src_embed(src) + self.pos[:, :src.shape[1]]
        t = self.tgt_embed(tgt) + self.pos[:, :tgt.shape[1]]
        return self.out(self.core(s, t, tgt_mask=self.mask, tgt_is_causal=True))


def build_model(config=None):
    return Translator()


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SRC)), torch.randint(0, VOCAB, (batch_size, TGT)))


def loss_fn(logits, batch):
    _, tgt = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tgt[:, 1:].reshape(-1))
