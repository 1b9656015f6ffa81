"""Train a generated package in an ordinary PyTorch loop (no atomc runtime involved).

    python examples/train_generated.py                   # GPT tiny, cut in three, 20 steps
    python examples/train_generated.py --package DIR     # a package `atomc codegen` wrote

The sub-models are chained by hand: sub-model 0 takes the model's inputs, each next one takes
what the previous returned, the last returns the logits. The original model's weights are
loaded by name, tied weights are made one parameter (`tie_parameters`), and AdamW sees the
sub-models' parameters as one model's. This is what the swap runtime does with one sub-model
on the GPU at a time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TEXT = (b"ATOM trains models larger than GPU memory by swapping sub-models between host and "
        b"device, and overlaps each load with the computation of the previous sub-model. ") * 8


def batches(batch_size: int, seq_len: int, generator: torch.Generator):
    data = torch.tensor(list(TEXT), dtype=torch.long)
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        yield (torch.stack([data[s:s + seq_len] for s in starts.tolist()]),)


def make_package(out: Path) -> Path:
    """GPT tiny, cut inside the first block and before the final norm (the tied embedding
    ends up in the first and the last sub-model)."""
    from atomc.codegen import generate
    from atomc.codegen.manual import plan_from_cuts
    from atomc.trace import trace_model

    traced = trace_model(HERE / "gpt.py", "tiny", 4)
    names = [n.name for n in traced.graph.nodes]
    plan = plan_from_cuts(traced, [names.index("h_0_mlp_c_fc"), names.index("ln_f")])
    return generate(plan, out, traced=traced)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", type=Path, help="generated package (default: make one)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    from atomc.codegen import load_package
    from atomc.trace import load_model_file

    with tempfile.TemporaryDirectory() as tmp:
        path = args.package or make_package(Path(tmp) / "gpt_tiny_pkg")
        package = load_package(path)
        plan = package.PLAN
        gpt = load_model_file(HERE / "gpt.py") if args.package is None else \
            load_model_file(Path(plan["model_path"]))
        original = gpt.build_model(plan["config"], **plan["options"])

        submodels = package.build_submodels()
        package.load_original_state_dict(submodels, original.state_dict())
        package.tie_parameters(submodels)  # a tied weight is one parameter from here on
        # one module holding them all: .parameters() lists a tied weight once
        optimizer = torch.optim.AdamW(torch.nn.ModuleList(submodels).parameters(), lr=args.lr)
        seq_len = package.BOUNDARIES[0]["inputs"][package.MODEL_INPUTS[0]]["shape"][1]
        data = batches(plan["batch_size"], seq_len, torch.Generator().manual_seed(0))

        losses = []
        for step in range(args.steps):
            batch = next(data)
            values = batch
            for sub in submodels[:-1]:
                values = sub(*values)
            logits = submodels[-1](*values)
            loss = gpt.loss_fn(logits, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            print(f"step {step:3d}  loss {loss.item():.4f}")

        # the trained weights go back into the original model under its own names
        original.load_state_dict(package.export_state_dict(submodels))
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
