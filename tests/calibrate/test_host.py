"""The host CPU AdamW rate: the per-machine cache, `--cpu-adam-gbps` resolution, shipped figures."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest

from atomc.calibrate import host
from atomc.calibrate.host import (
    CACHE_ENV,
    HOST_SOURCE_PREFIX,
    cache_path,
    host_adam_gbps,
    measure_adam_gbps,
    resolve_cpu_adam,
)
from atomc.errors import UsageError
from atomc.profile.hardware import hardware_names, load_hardware

from processes import SERIAL
from synthetic import block_profile


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def measured(monkeypatch):
    """Replace the benchmark with a counter; each call returns the next rate."""
    calls = []

    def fake(beside_copies: bool = False, states: str = "float32",
             transfer: str = "float32") -> float:
        calls.append(beside_copies)
        return (5.0 + len(calls)) / (2 if states == "bfloat16" else 1)

    monkeypatch.setattr(host, "measure_adam_gbps", fake)
    return calls


def test_second_call_reads_the_cache_instead_of_measuring(cache_dir, measured):
    first = host_adam_gbps()
    second = host_adam_gbps()
    assert len(measured) == 1
    assert first == second
    rate, source = first
    assert rate == 6.0
    assert source.startswith("measured on this host (") and str(cache_dir / "host.json") in source
    data = json.loads((cache_dir / "host.json").read_text())
    [entry] = data["hosts"].values()
    assert entry["adam_gbps"] == 6.0 and entry["identity"] == host.machine_identity()


def test_another_machine_identity_measures_again_and_both_are_kept(cache_dir, measured,
                                                                   monkeypatch):
    real = host.machine_identity()
    other = {**real, "hostname": real["hostname"] + "-other", "torch_threads": 64}
    identity = [real]
    monkeypatch.setattr(host, "machine_identity",
                        lambda beside=False, states="float32", transfer="float32": identity[0])
    assert host_adam_gbps()[0] == 6.0
    identity[0] = other
    assert host_adam_gbps()[0] == 7.0
    identity[0] = real
    assert host_adam_gbps()[0] == 6.0  # still cached
    assert len(measured) == 2
    assert len(json.loads((cache_dir / "host.json").read_text())["hosts"]) == 2


@pytest.mark.parametrize("content", [
    "{not json",
    "[1, 2]",
    '{"version": 1, "hosts": []}',
    '{"version": 999, "hosts": {}}',
    b"\xff\xfe\x00",
])
def test_a_broken_cache_file_is_measured_again_and_rewritten(cache_dir, measured, content):
    path = cache_dir / "host.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    assert host_adam_gbps()[0] == 6.0
    assert len(measured) == 1
    data = json.loads(path.read_text())
    assert data["version"] == host.CACHE_VERSION and len(data["hosts"]) == 1
    assert host_adam_gbps()[0] == 6.0 and len(measured) == 1


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), "fast", None, True])
def test_a_broken_entry_for_this_machine_is_measured_again(cache_dir, measured, bad):
    key = host._identity_key(host.machine_identity())
    stale = {"adam_gbps": 3.0, "identity": {"hostname": "elsewhere"}}
    (cache_dir / "host.json").write_text(json.dumps(
        {"version": host.CACHE_VERSION, "hosts": {key: {"adam_gbps": bad}, "elsewhere": stale}}))
    assert host_adam_gbps()[0] == 6.0
    hosts = json.loads((cache_dir / "host.json").read_text())["hosts"]
    assert hosts[key]["adam_gbps"] == 6.0 and hosts["elsewhere"] == stale


def test_the_cache_write_is_atomic_and_leaves_no_temporary_files(cache_dir, measured):
    (cache_dir / "host.json").write_text("{broken")
    host_adam_gbps()
    assert sorted(p.name for p in cache_dir.iterdir()) == ["host.json"]


def test_an_unwritable_cache_still_gives_the_rate_and_says_so(tmp_path, monkeypatch, measured):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # the cache folder would be a file
    rate, source = host_adam_gbps()
    assert rate == 6.0
    assert "not cached" in source and CACHE_ENV in source


def test_the_cache_lives_under_home_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_path() == tmp_path / ".cache" / "atomc" / "host.json"


# ---------------------------------------------------------------------------------------------
# --cpu-adam-gbps


@pytest.mark.parametrize(("value", "rate"), [("12.5", 12.5), (" 0 ", 0.0), ("3", 3.0),
                                             (8, 8.0), (2.5, 2.5)])
def test_a_number_is_taken_as_given(value, rate):
    assert resolve_cpu_adam(value, block_profile(num_blocks=1)) == (rate, "given")


@pytest.mark.parametrize("value", ["-1", -0.5, "nan", float("nan"), "fast", "", "8 GB/s",
                                   None, True])
def test_a_bad_value_names_the_flag_what_was_seen_and_what_to_give(value):
    with pytest.raises(UsageError) as e:
        resolve_cpu_adam(value, block_profile(num_blocks=1))
    msg = str(e.value)
    assert msg.startswith(f"--cpu-adam-gbps {value!r} ")
    assert '"auto"' in msg and "GB/s" in msg and "0 leaves the optimizer out" in msg


def test_auto_for_an_estimated_profile_takes_the_hardware_profiles_host_figure(cache_dir,
                                                                               measured):
    profile = replace(block_profile(num_blocks=1), hardware=load_hardware("a100-80gb"))
    assert profile.mode == "estimated"
    rate, source = resolve_cpu_adam("auto", profile)
    assert rate == pytest.approx(21.1)
    assert source.startswith(f"host figure of hardware profile a100-80gb: {HOST_SOURCE_PREFIX}")
    assert not measured and not list(cache_dir.iterdir())  # this host is not the target's


def test_auto_without_a_host_figure_asks_for_a_number():
    hw = replace(load_hardware("t4"), host_adam_gbps=0.0)
    profile = replace(block_profile(num_blocks=1), hardware=hw)
    with pytest.raises(UsageError) as e:
        resolve_cpu_adam("auto", profile)
    msg = str(e.value)
    assert "hardware profile t4" in msg and "host_adam_gbps is 0" in msg
    assert "--cpu-adam-gbps 8" in msg


def test_auto_for_an_estimated_profile_without_hardware_asks_for_a_number():
    with pytest.raises(UsageError, match="no hardware profile"):
        resolve_cpu_adam("auto", block_profile(num_blocks=1))


def test_auto_for_a_measured_profile_measures_this_host(cache_dir, measured):
    profile = replace(block_profile(num_blocks=1), mode="measured", device="cpu")
    rate, source = resolve_cpu_adam("Auto", profile)
    assert rate == 6.0 and source.startswith("measured on this host")
    assert resolve_cpu_adam("auto", profile) == (rate, source) and len(measured) == 1


def test_bfloat16_moments_are_measured_and_cached_apart_from_float32(cache_dir, measured):
    profile = replace(block_profile(num_blocks=1), mode="measured", device="cpu")
    fused = resolve_cpu_adam("auto", profile)
    low = resolve_cpu_adam("auto", profile, "bfloat16")
    assert fused[0] == 6.0 and low[0] == 3.5 and "bfloat16 moments" in low[1]
    assert resolve_cpu_adam("auto", profile, "bfloat16") == low and len(measured) == 2
    assert len(json.loads((cache_dir / "host.json").read_text())["hosts"]) == 2


def test_bfloat16_moments_on_an_estimated_profile_say_the_figure_is_for_float32(cache_dir,
                                                                              measured):
    profile = replace(block_profile(num_blocks=1), hardware=load_hardware("a100-80gb"))
    rate, source = resolve_cpu_adam("auto", profile, "bfloat16")
    assert rate == pytest.approx(21.1)
    assert (", for float32 moments and masters (the chunked update of bfloat16 moments"
            in source)
    assert "bfloat16" not in resolve_cpu_adam("auto", profile)[1]
    assert not measured  # this host is not the target's


# ---------------------------------------------------------------------------------------------
# shipped figures and the real benchmark


@pytest.mark.parametrize("name", hardware_names())
def test_every_shipped_hardware_profile_has_a_sourced_host_figure(name):
    hw = load_hardware(name)
    assert hw.host_adam_gbps > 0
    [sentence] = [s for s in hw.sources if s.startswith(HOST_SOURCE_PREFIX)]
    assert f"{hw.host_adam_gbps:g} GB/s" in sentence


@SERIAL
def test_the_real_benchmark_gives_a_finite_positive_rate_quickly():
    t0 = time.perf_counter()
    rate = measure_adam_gbps()
    took_s = time.perf_counter() - t0
    assert math.isfinite(rate) and rate > 0
    assert took_s < 5.0


@SERIAL
@pytest.mark.parametrize("states, transfer", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_the_real_benchmark_runs_the_runtimes_chunked_update(monkeypatch, states, transfer):
    """bfloat16 moments, or masters split beside bfloat16 images: the benchmark times the
    runtime's own chunked update, two warm-up steps and the timed ones."""
    from atomc.runtime import adamw

    calls = []
    original = adamw.ChunkedAdamW.step

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(adamw.ChunkedAdamW, "step", counted)
    rate = measure_adam_gbps(num_params=1 << 22, states=states, transfer=transfer)
    assert math.isfinite(rate) and rate > 0
    assert len(calls) == 2 + host.BENCH_STEPS
