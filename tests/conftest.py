"""Shared test set-up: `gpu` tests skip cleanly where CUDA is absent, `families` tests unless
`-m families` asks for them; the host measurements
`atomc partition --cpu-adam-gbps auto` caches go to a temporary folder, not the home folder
(processes the tests start inherit it)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

os.environ["ATOMC_CACHE_DIR"] = tempfile.mkdtemp(prefix="atomc-test-cache-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the survey of many families runs only when asked for (make families: -m families)
    if "families" not in (config.getoption("markexpr") or ""):
        survey = pytest.mark.skip(reason="the family survey: run it with make families")
        for item in items:
            if "families" in item.keywords:
                item.add_marker(survey)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
