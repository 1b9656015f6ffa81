"""A graph network written without a graph library, as GNN code often is: node features and an
edge list as inputs, messages gathered with index_select and summed into nodes with index_add_
on a zeros tensor, degree normalisation with scatter_add, a readout by mean."""

import torch
import torch.nn.functional as F
from torch import nn

NODES, EDGES, FEATS, CLASSES = 10, 30, 6, 3


class GraphConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.lin = nn.Linear(cin, cout)
        self.self_lin = nn.Linear(cin, cout, bias=False)

    def forward(self, x, edges):
        src, dst = edges[:, 0], edges[:, 1]
        flat = x.reshape(-1, x.shape[-1])
        msg = self.lin(flat).index_select(0, src)
        out = torch.zeros(flat.shape[0], msg.shape[-1], dtype=msg.dtype, device=msg.device)
        out.index_add_(0, dst, msg)
        deg = torch.zeros(flat.shape[0], dtype=msg.dtype, device=msg.device).scatter_add(
            0, dst, torch.ones_like(dst, dtype=msg.dtype))
        out = out / deg.clamp(min=1).unsqueeze(-1) + self.self_lin(flat)
        return out.reshape(*x.shape[:-1], -1)


class GCN(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.convs = nn.ModuleList([GraphConv(FEATS, width), GraphConv(width, width),
                                    GraphConv(width, width)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x, edges):
        # a batch of graphs as one graph: edge ids offset by each graph's first node
        offsets = torch.arange(x.shape[0], device=x.device).mul(NODES).view(-1, 1, 1)
        edges = (edges + offsets).reshape(-1, 2)
        for conv in self.convs:
            x = F.gelu(conv(x, edges))
        return self.head(self.norm(x).mean(1))


def build_model(config=None):
    return GCN()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, NODES, FEATS),
            torch.randint(0, NODES, (batch_size, EDGES, 2)))


def loss_fn(logits, batch):
    labels = torch.arange(logits.shape[0], device=logits.device) % CLASSES
    return F.cross_entropy(logits, labels)
