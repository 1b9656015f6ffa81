"""Regenerate the golden generated code in tests/golden/ (`make golden`).

The golden package is GPT tiny (examples/gpt.py, batch size 2) cut in two inside the first
block, with the tied embedding on both sides of the cut. The plan comes from an estimated
profile (hardware profile v100-32gb), so its numbers, and therefore its hash, are the same on
every machine. The package's own plan.json is the input tests/test_codegen.py regenerates from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = Path("tests/golden/gpt_tiny")


def main() -> int:
    os.chdir(REPO)  # the plan names the model as examples/gpt.py, relative to the checkout
    from atomc.codegen import generate
    from atomc.codegen.manual import plan_from_cuts
    from atomc.profile import profile_model
    from atomc.trace import trace_model

    traced = trace_model("examples/gpt.py", "tiny", 2)
    profile = profile_model(traced, target="v100-32gb", progress=False)
    cut = next(i for i, n in enumerate(traced.graph.nodes) if n.name == "h_0_attn_c_attn")
    plan = plan_from_cuts(profile, [cut])
    generate(plan, OUT, traced=traced)
    for path in sorted(OUT.iterdir()):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
