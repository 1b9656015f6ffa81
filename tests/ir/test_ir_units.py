"""IR JSON round trips and loader errors; size parsing."""

from __future__ import annotations

import json

import pytest

from atomc.errors import IRError, UsageError
from atomc.ir import OpGraph, Profile
from atomc.ir.documents import SCHEMA_VERSION
from atomc.profile import profile_model
from atomc.trace import trace_model
from atomc.units import format_bytes, parse_size


@pytest.fixture(scope="module")
def tiny_profile() -> Profile:
    return profile_model(trace_model("examples/gpt.py", "tiny", 2), target="v100-32gb")


def test_profile_round_trip(tiny_profile, tmp_path):
    path = tiny_profile.save(tmp_path / "p.json")
    again = Profile.load(path)
    assert again == tiny_profile
    assert again.content_hash() == tiny_profile.content_hash()
    data = json.loads(path.read_text())
    assert data["kind"] == "atomc.profile" and data["schema_version"] == SCHEMA_VERSION


def test_graph_round_trip(tiny_profile):
    graph = tiny_profile.graph
    assert OpGraph.from_json(graph.to_json()) == graph
    assert graph.structure_hash() == OpGraph.from_json(graph.to_json()).structure_hash()


def test_loader_rejects_other_version(tiny_profile, tmp_path):
    data = tiny_profile.to_json()
    data["schema_version"] = 99
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(IRError, match="schema_version 99"):
        Profile.load(path)


def test_loader_rejects_wrong_kind_and_malformed(tiny_profile, tmp_path):
    with pytest.raises(IRError, match=r"expected a atomc\.profile|is a atomc\.graph"):
        Profile.from_json(tiny_profile.graph.to_json(), "g.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(IRError, match="not valid JSON"):
        Profile.load(bad)
    data = tiny_profile.to_json()
    data["costs"][3]["fwd_ms"] = "fast"
    with pytest.raises(IRError, match=r"costs\[3\]\.fwd_ms: expected a number"):
        Profile.from_json(data, "p.json")
    del data["graph"]
    with pytest.raises(IRError, match="missing field 'graph'"):
        Profile.from_json(data, "p.json")
    with pytest.raises(IRError, match="does not exist"):
        Profile.load(tmp_path / "nothere.json")


@pytest.mark.parametrize("text,expected", [
    ("11GiB", 11 * 2**30), ("512MiB", 512 * 2**20), ("8GB", 8 * 10**9),
    ("1.5GiB", int(1.5 * 2**30)), ("4096", 4096), ("2 kib", 2048), (123, 123),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["11 Gibs", "eleven", "-1GiB", "1.2.3GB", "", "5 parsecs"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError, match=r"e\.g\. 11GiB"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(11 * 2**30) == "11.00 GiB"
    assert format_bytes(12) == "12 B"
