"""Regenerate the golden generated code in tests/golden/ (`make golden`).

Three packages, one per way a model reaches codegen:

- `gpt_tiny`: GPT tiny (examples/gpt.py, symbolic tracing) cut in two inside the first block,
  with the tied embedding on both sides of the cut;
- `llama_tiny`: the tiny Llama of examples/hf.py (torch.export) cut after the rotary
  embedding, so that the second sub-model holds both decoder layers (one layer class);
- `bert_tiny`: the tiny BERT of tests/models/hf_bert.py (torch.export: an encoder, its own
  output class, constants) cut after the embeddings.

Each plan comes from an estimated profile (hardware profile v100-32gb), so its numbers, and
therefore its hash, are the same on every machine. Each package's own plan.json is the input
tests/codegen/test_codegen.py regenerates it from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path("tests/golden")

# name -> (model file, config, batch size, the node the second sub-model starts at)
PACKAGES = {
    "gpt_tiny": ("examples/gpt.py", "tiny", 2, "h_0_attn_c_attn"),
    "llama_tiny": ("examples/hf.py", "tiny-llama", 2, "to_6"),
    "bert_tiny": ("tests/models/hf_bert.py", None, 2,
                  "encoder_layer_0_attention_self_query_weight_1"),
}


def write(name: str) -> Path:
    from atomc.codegen import generate
    from atomc.codegen.manual import plan_from_cuts
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    model, config, batch_size, start = PACKAGES[name]
    traced = trace_model(model, config, batch_size)
    profile = profile_model(traced, target="v100-32gb", progress=False)
    cut = next(i for i, n in enumerate(traced.graph.nodes) if n.name == start)
    plan = plan_from_cuts(profile, [cut])
    return generate(plan, GOLDEN / name, traced=traced)


def main() -> int:
    os.chdir(REPO)  # the plans name their model files relative to the checkout
    for name in sys.argv[1:] or PACKAGES:
        out = write(name)
        for path in sorted(out.iterdir()):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
