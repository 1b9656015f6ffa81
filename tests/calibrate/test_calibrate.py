"""Calibrate stage: measured steps of a generated package -> calibrated profile -> re-plan.

The mini GPT (examples/gpt.py) is profiled on the CPU, partitioned, generated and trained for a
few traced steps; the calibrated profile must reproduce the measured sub-models exactly and the
measured step closely, record its factors (JSON round trip), and drive the re-plan. Bad input
is refused with one line: a package against a plan it was not generated from, a profile the
plan was not made from, a failed step, another device, an estimated plan.
"""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from atomc.calibrate import (
    MIN_SCALE,
    Measurement,
    calibrate,
    measure_package,
    measure_runtime_costs,
    summarise,
)
from atomc.calibrate.host import resolve_cpu_adam
from atomc.cli import main as atomc_main
from atomc.codegen import generate
from atomc.errors import CalibrationError, RuntimeMismatchError
from atomc.ir import Profile
from atomc.partition import partition, profile_hash, recost
from atomc.profile import profile_model
from atomc.trace import trace_model

from processes import SERIAL

pytestmark = SERIAL  # the measured steps are compared with a profile measured beforehand
REPO = Path(__file__).resolve().parents[2]
GPT_PATH = REPO / "examples" / "gpt.py"
MICRO = 4
TEXT = b"def calibrate(profile, plan, measurement):\n    return profile  # measured, not guessed\n"


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """Profile, plan (C=2, four sub-models) and generated package of the mini GPT on the CPU."""
    root = tmp_path_factory.mktemp("calibrate")
    traced = trace_model(GPT_PATH, "mini", MICRO, device="cpu")
    profile = profile_model(traced, device="cpu", repeats=3, progress=False,
                            runtime_costs=measure_runtime_costs)
    profile.save(root / "mini.profile.json")
    plan = partition(profile, 8 << 20, reserve_bytes=0, accum=2, cpu_adam_gbps=4.0)
    assert len(plan.submodels) >= 3
    plan.save(root / "mini.plan.json")
    pkg = generate(plan, root / "pkg", traced=traced)
    text = root / "text.txt"
    text.write_bytes(TEXT * 40)
    measurement, traces = measure_package(pkg, steps=6, warmup=2, device="cpu",
                                          data=str(text))
    return {"root": root, "traced": traced, "profile": profile, "plan": plan, "pkg": pkg,
            "text": text, "measurement": measurement, "traces": traces}


def test_last_submodel_is_not_charged_a_recomputation(mini):
    """The runtime keeps the last sub-model's autograd graph from its forward to its backward:
    the plan's backward there is its nodes' backward alone; the others recompute. Each also
    costs the runtime's own time in a backward call, which a CPU profile measures."""
    profile, plan = mini["profile"], mini["plan"]
    own = profile.runtime.backward_ms
    assert own is not None and own > 0
    *rest, last = plan.submodels
    nodes = profile.costs[last.start:last.stop]
    assert last.bwd_ms == pytest.approx(sum(c.bwd_ms for c in nodes) + own, abs=1e-5)
    for sm in rest:
        nodes = profile.costs[sm.start:sm.stop]
        # less what the plan's activation policy keeps or sends (activations="auto")
        assert sm.bwd_ms == pytest.approx(sum(c.bwd_ms + c.fwd_ms for c in nodes) + own
                                          - sm.recompute_saved_ms, abs=1e-5)


def test_measurement_times_every_submodel_and_lane(mini):
    m, plan = mini["measurement"], mini["plan"]
    assert m.num_steps == 6 and m.warmup_steps == 2 and m.accum == plan.accum
    assert m.plan_hash == plan.content_hash() and m.device == plan.device
    assert all(s > 0 for s in m.step_ms)
    for s in m.submodels:
        assert s.fwd_ms > 0 and s.bwd_ms > 0 and s.offload_ms >= 0
    assert any(s.load_ms > 0 for s in m.submodels) and m.h2d_gbps > 0 and m.d2h_gbps > 0
    assert 0.5 < m.busy_fraction("compute") <= 1.0
    again = Measurement.from_json(json.loads(json.dumps(m.to_json())))
    assert again == m
    assert m.table().count("\n  P") == len(plan.submodels)
    traces = mini["traces"]  # every other step of the same run: disjoint measurements
    even = summarise(traces, num_submodels=len(plan.submodels), accum=m.accum,
                     activations=m.activations, device=m.device, plan_hash=m.plan_hash,
                     steps={t.step for t in traces[0:-1:2]})
    assert even.num_steps == 3 and set(even.step_ms) < set(m.step_ms)


def test_calibrated_profile_reproduces_the_measured_plan(mini):
    """Each sub-model's nodes are scaled to its measured times, so the plan's cuts on the
    calibrated profile predict the measured sub-models exactly, and the measured step closely
    (the simulator adds them up as the runtime runs them)."""
    profile, plan, m = mini["profile"], mini["plan"], mini["measurement"]
    cal = calibrate(profile, plan, m)
    record = cal.calibration
    assert record is not None and record.plan_hash == plan.content_hash()
    assert record.source_profile_hash == profile_hash(profile) == plan.profile_hash
    assert record.num_steps == 6 and record.accum == plan.accum
    after = recost(cal, plan, cpu_adam_gbps=record.cpu_adam_gbps)
    assert after.predicted_step_ms == pytest.approx(record.calibrated_step_ms)
    for sm, ms, scale in zip(after.submodels, m.submodels, record.submodels):
        assert sm.fwd_ms == pytest.approx(ms.fwd_ms, abs=1e-4)
        # else noise put the backward below its recomputation or the runtime's own time per
        # call, and the fit floors it
        if scale.bwd_scale > MIN_SCALE and ms.bwd_ms > profile.runtime.backward_ms:
            assert sm.bwd_ms == pytest.approx(ms.bwd_ms, abs=1e-4)
        assert scale.fwd_scale > 0 and scale.bwd_scale > 0
        before = sum(c.fwd_ms for c in profile.costs[scale.start:scale.stop])
        now = sum(c.fwd_ms for c in cal.costs[scale.start:scale.stop])
        assert now == pytest.approx(before * scale.fwd_scale)
    # the host-thread time is fitted to the measured step (it is 0 when the parts' medians
    # already add up to more: a shared machine is noisy)
    assert after.predicted_step_ms == pytest.approx(m.median_step_ms, rel=0.1)
    assert cal.h2d_gbps == pytest.approx(m.h2d_gbps)
    assert record.h2d_scale == pytest.approx(m.h2d_gbps / profile.h2d_gbps)
    assert record.cpu_adam_gbps > 0
    # on the CPU the runtime thread's own time between actions closes what events leave open
    assert record.host_gap_ms >= 0 and after.host_gap_ms == (record.host_gap_ms or None)
    rate, source = resolve_cpu_adam("auto", cal)  # a re-plan takes the measured update rate
    assert rate == record.cpu_adam_gbps and "calibrated" in source
    replan = partition(cal, plan.capacity_bytes, reserve_bytes=0, accum=plan.accum,
                       cpu_adam_gbps=rate)
    assert replan.profile_hash == profile_hash(cal)


def test_calibration_round_trips_and_older_profiles_hash_as_before(mini, tmp_path):
    profile, plan, m = mini["profile"], mini["plan"], mini["measurement"]
    cal = calibrate(profile, plan, m)
    path = cal.save(tmp_path / "cal.profile.json")
    loaded = Profile.load(path)
    assert loaded == cal and loaded.calibration == cal.calibration
    assert loaded.content_hash() == cal.content_hash() == profile_hash(cal)
    data = json.loads((mini["root"] / "mini.profile.json").read_text())
    assert "calibration" not in data  # uncalibrated profiles are written as before
    assert Profile.from_json(data).content_hash() == profile_hash(profile) == plan.profile_hash


def test_cli_prints_before_and_after_and_draws_the_timeline(mini, tmp_path, capsys):
    root = mini["root"]
    out = tmp_path / "cal.profile.json"
    svg = tmp_path / "t.svg"
    code = atomc_main(["calibrate", str(mini["pkg"]), "--device", "cpu", "--steps", "2",
                       "--warmup", "1", "--data", str(mini["text"]), "-o", str(out),
                       "--timeline", str(svg)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "step (median)" in text and "busy compute" in text and "scale factors" in text
    assert "re-planned from the calibrated profile" in text
    assert Profile.load(out).calibration is not None  # the profile was found beside the package
    assert (tmp_path / "cal.plan.json").is_file()  # the re-plan, beside it
    panels = list(ET.parse(svg).getroot())
    assert len(panels) == 2
    titles = [p.find("{http://www.w3.org/2000/svg}title").text for p in panels]
    assert titles[0].startswith("measured") and titles[1].startswith("calibrated prediction")
    assert root.joinpath("mini.profile.json").is_file()


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_package_and_plan_must_match(mini, tmp_path, capsys):
    """Calibrating a package against a plan it was not generated from is refused."""
    other = partition(mini["profile"], 16 << 20, reserve_bytes=0, accum=1, cpu_adam_gbps=4.0)
    path = other.save(tmp_path / "other.plan.json")
    assert atomc_main(["calibrate", str(mini["pkg"]), "--device", "cpu", "--plan",
                       str(path)]) == 2  # before looking for that plan's profile
    err = _one_line_error(capsys)
    assert "was generated for plan" in err and other.content_hash() in err
    with pytest.raises(RuntimeMismatchError):
        measure_package(mini["pkg"], steps=1, warmup=0, device="cpu", plan=other)
    # a measurement of one plan's package cannot calibrate another plan
    with pytest.raises(CalibrationError, match="not from this plan"):
        calibrate(mini["profile"], other, mini["measurement"])


def test_profile_must_be_the_plans(mini, tmp_path, capsys):
    profile = mini["profile"]
    costs = (dataclasses.replace(profile.costs[-2], fwd_ms=profile.costs[-2].fwd_ms + 1),)
    other = dataclasses.replace(profile, costs=profile.costs[:-2] + costs + profile.costs[-1:])
    with pytest.raises(CalibrationError, match="made from profile"):
        calibrate(other, mini["plan"], mini["measurement"])
    path = other.save(tmp_path / "other.profile.json")
    assert atomc_main(["calibrate", str(mini["pkg"]), "--device", "cpu", "--steps", "1",
                       "--warmup", "0", "--data", str(mini["text"]), "--profile",
                       str(path)]) == 2
    assert "made from profile" in _one_line_error(capsys)


def test_unusable_measurements_are_refused(mini):
    """A failed step, a non-finite loss, another device, another C: nothing is calibrated."""
    profile, plan, m = mini["profile"], mini["plan"], mini["measurement"]
    with pytest.raises(CalibrationError, match=r"cuda:0 .*but the plan was made for cpu"):
        calibrate(profile, plan, dataclasses.replace(m, device="cuda:0 (NVIDIA H100 80GB HBM3)"))
    with pytest.raises(CalibrationError, match="loss of nan"):
        calibrate(profile, plan, dataclasses.replace(m, losses=(*m.losses, float("nan"))))
    with pytest.raises(CalibrationError, match="C=3"):
        calibrate(profile, plan, dataclasses.replace(m, accum=3))
    with pytest.raises(CalibrationError, match="no backward of sub-model"):
        traces = mini["traces"]
        cut = [dataclasses.replace(t) for t in traces]
        cut[0].events = [e for e in cut[0].events if e.kind != "backward"]
        summarise(cut, num_submodels=len(plan.submodels), accum=plan.accum,
                  activations=plan.activations, device=m.device, plan_hash=m.plan_hash)

    def out_of_vocabulary(step: int) -> torch.Tensor:
        return torch.full((plan.accum * MICRO, 64), 10**6, dtype=torch.int64)

    with pytest.raises(CalibrationError, match=r"step 1 of 3 failed \(IndexError"):
        measure_package(mini["pkg"], steps=1, warmup=1, device="cpu", batches=out_of_vocabulary)


def test_estimated_plan_is_refused_on_this_device(mini, tmp_path, capsys):
    traced = mini["traced"]
    estimated = profile_model(traced, target="v100-32gb", progress=False)
    estimated.save(tmp_path / "v100.profile.json")
    plan = partition(estimated, 4 << 30, accum=1, cpu_adam_gbps=8.0)
    pkg = generate(plan, tmp_path / "pkg", traced=traced)
    assert atomc_main(["calibrate", str(pkg), "--device", "cpu", "--steps", "1"]) == 2
    err = _one_line_error(capsys)
    assert "estimated for v100-32gb" in err and "profile on this device" in err
