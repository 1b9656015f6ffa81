"""Place-stage benchmark: DT-FM's five 64-GPU scenarios, 8 stages x 8 replicas.

Every strategy gets the same wall-clock budget, side by side in one run, and the table shows
the cost of its best layout (DP, PP, total = DP + 2*PP, seconds per step in DT-FM's model),
when it found that layout, and how many candidate layouts it evaluated.

- ours:   genetic algorithm + DT-FM's local search (the default of `atomc place`)
- kl:     the same with the Kernighan-Lin gain
- random: random layouts
- "random start" rows: the genetic algorithms started from random partitions only, without
  the two link-built seeds (DT-FM's own setting), to isolate what the local search does.

Message sizes default to DT-FM's scheduler for GPT-3 XL (c_PP 0.5 GB, c_DP 0.9 GB).
Usage: python bench/place_bench.py [--budget-s 5] [--seeds 1] [--c-pp 500MB] [--c-dp 900MB]
"""

from __future__ import annotations

import argparse
import statistics
import time

from atomc.place import Budget, CostModel, scenario_names, search_placement
from atomc.place.layout import device_matrix
from atomc.place.network import build_scenario
from atomc.units import parse_size

RUNS = [("ours", True), ("kl", True), ("random", True), ("ours", False), ("kl", False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=5.0)
    parser.add_argument(
        "--seeds", type=int, default=1, help="seeds per strategy (medians are shown)"
    )
    parser.add_argument("--c-pp", default="500MB")
    parser.add_argument("--c-dp", default="900MB")
    parser.add_argument("--scenarios", nargs="*", default=scenario_names())
    args = parser.parse_args()
    c_pp, c_dp = parse_size(args.c_pp), parse_size(args.c_dp)

    print(
        f"# 8 x 8 on 64 GPUs, c_PP {c_pp:,} B, c_DP {c_dp:,} B, {args.budget_s:g} s per run, "
        f"{args.seeds} seed(s); costs in s per step (DT-FM model)"
    )
    print(
        "| scenario | strategy | total s | DP s | PP s | best found at s | evaluations | vs random "
        "| regions per pipeline | regions per DP group |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.scenarios:
        network = build_scenario(name)
        rows = []
        for strategy, seeded in RUNS:
            runs = []
            for seed in range(args.seeds):
                model = CostModel(network, 8, 8, c_pp, c_dp)
                start = time.perf_counter()
                result = search_placement(
                    model,
                    strategy,
                    seed=seed,
                    budget=Budget(time_s=args.budget_s),
                    link_seeds=seeded,
                )
                assert time.perf_counter() - start < args.budget_s + 2.0
                cost = model.evaluate(result.groups)
                matrix = device_matrix(model, result.groups, cost)
                runs.append(
                    (
                        cost.total_s,
                        cost.dp_s,
                        cost.pp_s,
                        result.history[-1][1],
                        result.evaluations,
                        _spread(network, matrix.T),
                        _spread(network, matrix),
                    )
                )
            runs.sort()
            median = runs[len(runs) // 2]
            label = strategy if seeded or strategy == "random" else f"{strategy} (random start)"
            rows.append((label, median, statistics.median(r[3] for r in runs)))
        random_total = next(m[0] for label, m, _ in rows if label == "random")
        for label, (total, dp, pp, _, evals, per_pipeline, per_group), found_s in rows:
            print(
                f"| {name} | {label} | {total:.3f} | {dp:.3f} | {pp:.3f} | {found_s:.2f} "
                f"| {evals} | "
                f"{random_total / total:.2f}x | {per_pipeline} | {per_group} |",
                flush=True,
            )


def _spread(network, rows) -> str:
    """Distinct regions (instances, organizations) in each row of device indices: min-max."""
    sizes = sorted(len({network.devices[d].region for d in row}) for row in rows)
    return str(sizes[0]) if sizes[0] == sizes[-1] else f"{sizes[0]}-{sizes[-1]}"


if __name__ == "__main__":
    main()
