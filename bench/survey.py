"""The coverage surveys: every model of a suite through atomc's whole chain, one CSV row each.

    python bench/survey.py --suite timm|hf|torchvision [--only NAME ...] [--slice K/N]
    python bench/survey.py --summary

A model passes when all of these hold: it profiles on the CPU from a meta-device trace, the
partitioner plans it in 3 or more sub-models, codegen generates the package from the plan,
the sub-models run as the runtimes run them (detached at every cut, gradient flags from the
package) give the model's outputs and every parameter's gradient in float64 (float32 where
the eager model does not run in float64), SwapTrainer gives plain AdamW's losses and weights
after 3 steps in float32, and a plan for bfloat16 weights trains (tests/helpers/
model_chain.py has each check; the tests run the same ones). A model is `refused` when atomc
stops with one line that names a documented limit (docs/model-files.md, Limits; LIMITS here)
and a source line; anything else is `fail`, and a fail whose check found different numbers
without an error says `differs` in its reason.

Each model runs in a process of its own (a crash or a timeout is that model's row); rows are
merged into bench/survey/SUITE.csv by model, so slices can run one after another. `--summary`
writes the table of the three CSVs into docs/model-files.md.

The suites:
- timm: PyTorch's timm benchmark list (benchmarks/dynamo/timm_models_list.txt at pytorch/
  pytorch 06d9861d) and every `test_*` model timm registers, at the smallest image size each
  architecture takes (tests/models/timm_zoo.py);
- hf: PyTorch's Hugging Face benchmark list (benchmarks/dynamo/huggingface_models_list.txt at
  pytorch/pytorch 0fb2b95f) from tiny configurations of the same classes
  (tests/models/hf_benchmark.py), and the 95 families of tests/models/hf_families.py;
- torchvision: its classification, segmentation and detection models of at most
  LARGEST_TORCHVISION parameters (tests/models/torchvision_zoo.py); it runs in a virtual
  environment of its own, with the CUDA torch torchvision is built for (make survey).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import faulthandler
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.append(str(REPO))  # bench/_provenance.py

from bench._provenance import commit as git_commit

MODELS = REPO / "tests" / "models"
OUT = REPO / "bench" / "survey"
DOC = REPO / "docs" / "model-files.md"
SUITES = ("timm", "hf", "torchvision")
COLUMNS = ("model", "source", "status", "reason", "submodels", "seconds", "dtype", "grad_diff",
           "weight_diff", "date", "commit")
# PyTorch's timm benchmark list (pytorch/pytorch 06d9861d, October 2025), batch sizes left out
TIMM_LIST = ("adv_inception_v3", "beit_base_patch16_224", "convnextv2_nano.fcmae_ft_in22k_in1k",
             "deit_base_distilled_patch16_224", "deit_tiny_patch16_224.fb_in1k", "dm_nfnet_f0",
             "ghostnet_100", "inception_v3", "mobilenetv2_100", "mobilenetv3_large_100",
             "mobilevit_s", "nfnet_l0", "repvgg_a2", "swin_base_patch4_window7_224",
             "tf_efficientnet_b0", "visformer_small", "vit_base_patch14_dinov2.lvd142m",
             "vit_base_patch16_siglip_256")
# torchvision models above this many parameters (ViT-H/14, ViT-L, RegNetY-128GF, ConvNeXt-L)
# hold more than this 24 GiB machine has room for in the float64 checks, beside the others
LARGEST_TORCHVISION = 150e6
# the documented limits a refusal may name (docs/model-files.md): name -> what its message says
LIMITS = {
    "values read in forward (control flow on tensor values, value-dependent shapes)":
        r"data-dependent|Compute without reading tensor values|value-dependent",
    "a forward that computes a gradient": r"computes a gradient",
    "a forward that writes a parameter in place": r"writes .*parameter.* in place",
    "LayerDrop": r"layerdrop",
    "a custom autograd Function torch.export cannot keep": r"backward is not .*derivative",
    "different Python paths in float64 and float32": r"different graph in torch\.float64",
    "parametrizations.orthogonal": r"orthogonal",
}
# the file of the runtime's costs the parent measured, for its model processes
COSTS = "ATOMC_SURVEY_RUNTIME_COSTS"
SOURCE_LINE = re.compile(r"[\w./-]+\.py:\d+")
# the chained sub-models to float64's rounding (float32's as the tests hold them)
TOLERANCES = {"float64": {"chain": 1e-10}, "float32": {"chain": 1e-5}}
# SwapTrainer against AdamW, 3 steps in float32 (float64 convolutions on a CPU take several
# times as long): sub-model boundaries change which kernels reduce in what order, up to about
# 5e-6 (BEiT, tests/test_families.py); a wrong gradient at a cut moves weights by 1e-3
SWAP = {"rel": 1e-5, "atol": 1e-5}
# the same in float64, where a model's float32 training amplifies its rounding
FLOAT64_SWAP = {"rel": 1e-9, "atol": 1e-9, "state_rtol": 1e-9}
# a float64 chain whose graph casts to float32 is held to float32's rounding
FLOAT32_ROUNDING = 1e-6


def cases(suite: str) -> list[tuple[str, str, Path]]:
    """(row name, where the model comes from, model file) of every model of `suite`; the row
    name is the model file's configuration."""
    if suite == "timm":
        from shims import import_timm

        timm = import_timm()
        zoo = MODELS / "timm_zoo.py"
        return ([(n, "pytorch timm list", zoo) for n in TIMM_LIST] +
                [(n, "timm test_*", zoo) for n in timm.list_models("test_*")])
    if suite == "hf":
        from atomc.trace import load_model_file

        bench, families = MODELS / "hf_benchmark.py", MODELS / "hf_families.py"
        return ([(n, "pytorch hf list", bench) for n in load_model_file(bench).NAMES] +
                [(n, "families", families) for n in load_model_file(families).NAMES])
    if suite == "torchvision":
        from atomc.trace import load_model_file

        zoo = load_model_file(MODELS / "torchvision_zoo.py")
        return [(n, zoo.kind_of(n), MODELS / "torchvision_zoo.py") for n in zoo.NAMES
                if sum(p.numel() for p in zoo.on_meta(n).parameters()) <= LARGEST_TORCHVISION]
    raise SystemExit(f"survey: unknown suite {suite!r}; give one of {', '.join(SUITES)}")


# ---------------------------------------------------------------------------------------------
# one model, in a process of its own


def survey_one(path: Path, config: str) -> dict:
    """The row of one model: its status, reason, sub-models, seconds and largest differences."""
    import torch

    from atomc.errors import AtomcError
    from atomc.ir import RuntimeCosts

    from helpers import model_chain as mc

    costs = os.environ.get(COSTS)
    if costs:  # the parent's one measurement of the runtime's own costs on this machine
        measured = RuntimeCosts(**json.loads(Path(costs).read_text()))
        mc.RUNTIME_COSTS = lambda device: measured
    mc.PROFILE_ROUNDS = 1
    name = f"{path}::{config}"
    row = {"submodels": "", "dtype": "", "grad_diff": "", "weight_diff": ""}
    start = time.perf_counter()
    step = "profile, partition, codegen"
    try:
        with tempfile.TemporaryDirectory(prefix="atomc-survey-") as root, \
                contextlib.redirect_stdout(io.StringIO()):
            out, plan, reference = mc.chain(name, Path(root))
            row["submodels"] = len(plan.submodels)
            _log_time("profile, partition, codegen", start)
            step = "plan of 3+ sub-models"
            assert len(plan.submodels) >= 3, f"{len(plan.submodels)} sub-models"
            dtype = torch.float64 if _eager_runs_in(mc, reference, torch.float64) else \
                torch.float32
            row["dtype"] = str(dtype).removeprefix("torch.")
            tol = TOLERANCES[row["dtype"]]
            step = f"chained sub-models against the model in {row['dtype']}"
            try:
                grad = mc.check_chained_submodels_equal_the_model(Path(root), name, dtype,
                                                                  tol["chain"])
            except AssertionError as e:
                if dtype != torch.float64 or not _casts_to_float32(out):
                    raise
                # the graph rounds to float32 where the model casts (`.float()`), or where
                # the path it gives torch.export does (timm's position-embedding resampling)
                grad = mc.check_chained_submodels_equal_the_model(Path(root), name, dtype,
                                                                  FLOAT32_ROUNDING)
                row["note"] = (f"float64 to float32 rounding, as the traced graph casts to "
                               f"float32 ({_one_line(e, 160)})")
            row["grad_diff"] = f"{grad:.3g}"
            _log_time("chained", start)
            step = "SwapTrainer against AdamW in float32"
            run32 = mc.three_steps(Path(root), name)
            try:
                weight = mc.assert_same_training(run32, SWAP["rel"], SWAP["atol"])
            except AssertionError:
                if dtype != torch.float64:
                    raise
                step = "SwapTrainer against AdamW in float64"
                weight, note = _float32_amplifies_rounding(mc, run32,
                                                           mc.three_steps(Path(root), name,
                                                                          torch.float64))
                _add_note(row, note)
            row["weight_diff"] = f"{weight:.3g}"
            _log_time("swap", start)
            step = "bfloat16 plan"
            drift = mc.check_bfloat16_plan_trains_within_one_percent(Path(root), name)
            held = mc.bfloat16_tolerance(drift)
            if held > mc.bfloat16_tolerance(0.0):
                _add_note(row, f"bfloat16's first loss held to {held:.0%} of float32's: "
                               f"bfloat16 rounding moves the eager loss {drift:.0%} by itself")
            _log_time("bfloat16", start)
        row.update(status="pass", reason=row.pop("note", ""))
    except AtomcError as e:
        traceback.print_exc()  # into the model's log
        row.update(_refusal(str(e)))
    except AssertionError as e:
        traceback.print_exc()
        what = "differs" if step.startswith(("chained", "SwapTrainer")) else "fails"
        row.update(status="fail", reason=f"{step} {what}: {_one_line(e)}")
    except Exception as e:  # noqa: BLE001 - any other failure is this model's row
        traceback.print_exc()
        row.update(status="fail", reason=f"{step}: {type(e).__name__}: {_one_line(e)}"
                                         f"{_where(e)}")
    row["seconds"] = f"{time.perf_counter() - start:.0f}"
    return row


def _add_note(row: dict, note: str) -> None:
    row["note"] = "; ".join(filter(None, [row.get("note"), note]))


def _float32_amplifies_rounding(mc, run32, run64) -> tuple[float, str]:
    """Where SwapTrainer's float32 losses miss AdamW's, the two are held to float64's rounding
    instead, and float32's gap to what float32 itself moves the model: plain AdamW's float32
    losses against its float64 ones. A model whose training turns rounding into percents
    (BatchNorm over a few values, LeViT's) passes only where both hold; a wrong gradient at a
    cut shows in float64 too. Returns the float64 run's largest weight difference and a note."""
    weight = mc.assert_same_training(run64, **FLOAT64_SWAP)
    gap = _largest_relative(run32.swapped, run32.plain)
    drift = _largest_relative(run32.plain, run64.plain)
    assert gap <= drift, (f"SwapTrainer's float32 losses are {gap:.2g} from AdamW's, beyond "
                          f"the {drift:.2g} that float32 moves AdamW's own")
    return weight, (f"float32 amplifies rounding: SwapTrainer's losses {gap:.2g} from AdamW's, "
                    f"AdamW's own float32 ones {drift:.2g} from float64; equal in float64")


def _largest_relative(got: list[float], expected: list[float]) -> float:
    return max(abs(g - e) / max(abs(e), 1e-12) for g, e in zip(got, expected))


def _log_time(what: str, start: float) -> None:
    print(f"survey: {what} done at {time.perf_counter() - start:.1f} s", file=sys.stderr,
          flush=True)


def _casts_to_float32(package: Path) -> bool:
    """Whether the generated sub-models cast anything to float32 explicitly."""
    return any("torch.float32" in p.read_text() for p in package.glob("submodel_*.py"))


def _eager_runs_in(mc, reference, dtype) -> bool:
    """Whether the eager model's forward, loss and backward run in `dtype` (some of
    transformers' kernels have no float64 CPU version) and give finite outputs (CANINE's
    float64 forward gives NaN where it masks with float32's most negative value)."""
    import torch
    from torch.utils._pytree import tree_leaves

    model = mc.original(reference, dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in reference.inputs)
    try:
        outputs = model(*inputs)
        loss = reference.module.loss_fn(outputs, inputs)
        loss.backward()
    except RuntimeError:
        return False
    return all(torch.isfinite(x).all() for x in (*tree_leaves(outputs), loss)
               if isinstance(x, torch.Tensor) and x.is_floating_point())


def _refusal(message: str) -> dict:
    """A refusal's row: `refused` when its message is one line naming a documented limit and
    a source line, `fail` otherwise."""
    line = _one_line(message)
    limit = next((k for k, pattern in LIMITS.items() if re.search(pattern, message, re.I)),
                 None)
    if "\n" in message.strip():
        return {"status": "fail", "reason": f"refusal of more than one line: {line}"}
    if limit is None:
        return {"status": "fail", "reason": f"refusal naming no documented limit: {line}"}
    if not SOURCE_LINE.search(message):
        return {"status": "fail", "reason": f"refusal naming no source line: {line}"}
    lines = list(dict.fromkeys(Path(m).name for m in SOURCE_LINE.findall(message)))
    return {"status": "refused", "reason": f"{limit} (at {', '.join(lines[:4])}): {line}"}


def _one_line(e: BaseException | str, limit: int = 400) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _where(e: BaseException) -> str:
    """The innermost line of atomc's own that the failure passed through."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if Path(f.filename).is_relative_to(REPO)]
    if not frames:
        return ""
    return f" (at {Path(frames[-1].filename).relative_to(REPO)}:{frames[-1].lineno})"


# ---------------------------------------------------------------------------------------------
# the suite, model by model


def run_suite(suite: str, only: list[str], part: tuple[int, int], timeout: float,
              resume: bool = False, csv_path: Path | None = None) -> Path:
    todo = cases(suite)
    order = [n for n, _, _ in todo]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{suite}.models").write_text("".join(f"{n}\n" for n in order))  # the summary's
    if only:
        unknown = set(only) - {n for n, _, _ in todo}
        if unknown:
            raise SystemExit(f"survey: {', '.join(sorted(unknown))} not in the {suite} suite")
        todo = [c for c in todo if c[0] in only]
    k, n = part
    todo = todo[k - 1::n]
    csv_path = csv_path or OUT / f"{suite}.csv"
    if resume:
        done = {r["model"] for r in _read(csv_path)}
        todo = [c for c in todo if c[0] not in done]
    logs = REPO / "out" / "survey" / suite
    logs.mkdir(parents=True, exist_ok=True)
    commit = git_commit()
    # measured once for the whole run: the runtime's costs are this machine's, not a model's
    # (each profile holds them), and measuring them took 10-30 s a model
    import torch

    from atomc.calibrate import measure_runtime_costs

    costs = logs / "runtime_costs.json"
    costs.write_text(json.dumps(dataclasses.asdict(measure_runtime_costs(torch.device("cpu")))))
    os.environ[COSTS] = str(costs)
    for i, (name, source, path) in enumerate(todo, 1):
        log = logs / (re.sub(r"[^\w.-]", "_", name) + ".log")
        row = _run_child(path, name, timeout, log)
        row.update(model=name, source=source, date=datetime.date.today().isoformat(),
                   commit=commit)
        _merge(csv_path, order, row)
        print(f"[{i}/{len(todo)}] {name}: {row['status']} {row['seconds']} s "
              f"{row['reason'][:160]}", flush=True)
    return csv_path


def _run_child(path: Path, config: str, timeout: float, log: Path) -> dict:
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--one", str(path), config]
    with log.open("w") as err:
        try:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                  timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {"status": "fail", "reason": f"timed out after {timeout:.0f} s",
                    "seconds": f"{timeout:.0f}"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        return {"status": "fail", "reason": f"the process ended ({why}): {_one_line(tail[0])}",
                "seconds": f"{time.perf_counter() - start:.0f}"}
    return json.loads(lines[-1])


def _merge(csv_path: Path, order: list[str], row: dict) -> None:
    """Writes `row` into the suite's CSV in place of that model's earlier row, the rows in the
    suite's order (`order`: its models' names)."""
    rows = {r["model"]: r for r in _read(csv_path)}
    rows[row["model"]] = {c: row.get(c, "") for c in COLUMNS}
    rank = {n: i for i, n in enumerate(order)}
    rows = dict(sorted(rows.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = csv_path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows.values())
    tmp.replace(csv_path)


def _read(csv_path: Path) -> list[dict]:
    if not csv_path.exists():
        return []
    with csv_path.open(newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------
# the summary in docs/model-files.md

BEGIN, END = "<!-- survey table: bench/survey.py --summary -->", "<!-- end of survey table -->"


def summary_table() -> str:
    lines = [("| suite | surveyed | pass | refused | fail | differs without an error | "
              "seconds | date | commit |"), "|---|---|---|---|---|---|---|---|---|"]
    for suite in SUITES:
        rows = _read(OUT / f"{suite}.csv")
        listed = OUT / f"{suite}.models"
        size = len(listed.read_text().split()) if listed.exists() else len(rows)
        if not rows:
            lines.append(f"| {suite} | 0 of {size} | | | | | | | |")
            continue
        count = {s: sum(r["status"] == s for r in rows) for s in ("pass", "refused", "fail")}
        differs = sum(r["status"] == "fail" and " differs: " in r["reason"] for r in rows)
        seconds = sum(float(r["seconds"] or 0) for r in rows)
        dates = sorted({r["date"] for r in rows})
        commits = sorted({r["commit"] for r in rows})
        lines.append(f"| [{suite}](../bench/survey/{suite}.csv) | {len(rows)} of {size} | "
                     f"{count['pass']} "
                     f"({100 * count['pass'] / len(rows):.0f}%) | {count['refused']} | "
                     f"{count['fail']} | {differs} | {seconds:.0f} | "
                     f"{dates[0] if len(dates) == 1 else dates[0] + ' to ' + dates[-1]} | "
                     f"{', '.join(commits)} |")
    return "\n".join(lines)


def write_summary() -> None:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"survey: {DOC} has no survey table markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{summary_table()}\n{END}{tail}")
    print(summary_table())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=SUITES)
    ap.add_argument("--only", nargs="+", default=[], help="these models of the suite alone")
    ap.add_argument("--slice", default="1/1", help="K/N: every N-th model from the K-th")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per model")
    ap.add_argument("--resume", action="store_true", help="skip models the CSV has a row for")
    ap.add_argument("--csv", type=Path, help="write the rows here (default: bench/survey/SUITE"
                                             ".csv), for slices run side by side")
    ap.add_argument("--summary", action="store_true", help="write docs/model-files.md's table")
    ap.add_argument("--one", nargs=2, metavar=("FILE", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID: where a slow model is
        print(json.dumps(survey_one(Path(args.one[0]), args.one[1])))
        return 0
    if args.suite:
        k, n = (int(x) for x in args.slice.split("/"))
        path = run_suite(args.suite, args.only, (k, n), args.timeout, args.resume, args.csv)
        print(f"wrote {path}")
    if args.summary:
        write_summary()
    if not (args.suite or args.summary):
        ap.error("give --suite or --summary")
    return 0


if __name__ == "__main__":
    sys.exit(main())
