"""Shared test set-up: `gpu` tests skip cleanly where CUDA is absent, `families` tests unless
`-m families` asks for them and `long` ones (multi-process scenarios past make test's 12
minutes on CI, each of whose parts a shorter test checks) unless `-m long` does; the host
measurements `atomc partition --cpu-adam-gbps auto` caches go to a temporary folder, not the
home folder (processes the tests start inherit it), removed at the end.

`make test` runs the tests in pytest-xdist workers (-n 2 --dist loadgroup
--no-loadscope-reorder). The tests of one module share a worker, so that its module-scoped
fixtures are built once, unless a test names its own group with an xdist_group mark
(tests/test_models.py: one per model, whose packages are built once for all of its checks;
processes.SERIAL: tests that start processes by the handful or time the machine, one after
another; `gpu` tests join them). Groups with a `slow` test are handed out first and then the
larger groups, so that the small ones fill the end rather than one long group running while
the other worker idles. Each worker takes its share of the cores for torch's threads, and the
processes it starts inherit that share: threads beyond the cores only spin. The `python`
processes a worker starts fork from a server that has imported torch and hivemind once
(tests/helpers/forkserver.py; ATOMC_TEST_FORKSERVER=0 executes them afresh instead).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import forkserver
from processes import SERIAL

os.environ["ATOMC_CACHE_DIR"] = tempfile.mkdtemp(prefix="atomc-test-cache-")
atexit.register(shutil.rmtree, os.environ["ATOMC_CACHE_DIR"], ignore_errors=True)

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
# where each worker writes the group of every test it collected, for the controller's
# scheduler (GroupScheduling below)
GROUPS = "ATOMC_TEST_GROUPS"

if WORKER:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _threads = max(1, (_cores or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)


def pytest_configure(config: pytest.Config) -> None:
    if not WORKER and getattr(config.option, "numprocesses", None):  # pytest-xdist's -n
        os.environ[GROUPS] = tempfile.mkdtemp(prefix="atomc-test-groups-")
        atexit.register(shutil.rmtree, os.environ[GROUPS], ignore_errors=True)
    else:  # a process that runs tests: its `python` children fork from a preloaded server
        forkserver.install()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the survey of many families runs only when asked for (make families: -m families), and
    # the long multi-process scenarios likewise (make test-long: -m long)
    asked = config.getoption("markexpr") or ""
    for mark, reason in (("families", "the family survey: run it with make families"),
                         ("long", "a long scenario: run it with make test-long")):
        if mark not in asked:
            for item in items:
                if mark in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=reason))
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if WORKER:
        _group_for_workers(items)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the model cases' packages are generated (tests/helpers/model_chain.py), once per
    process for test_models and test_families."""
    return tmp_path_factory.mktemp("models")


def _group_for_workers(items: list[pytest.Item]) -> None:
    """Put each test without an xdist_group mark in its module's group (a `gpu` test in
    SERIAL's), order the groups (those with a slow test first, then by size, ties in collection
    order), and write each test's group where the controller's scheduler reads it."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        # as xdist names the group of a test with several marks
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if not names:
            mark = SERIAL if "gpu" in item.keywords else pytest.mark.xdist_group(
                item.nodeid.split("::")[0])
            item.add_marker(mark)
            names = [mark.args[0]]
        groups.setdefault("_".join(names), []).append(item)
    def long_first(group: list[pytest.Item]) -> bool:
        return not any("slow" in i.keywords or "long" in i.keywords for i in group)

    order = sorted(groups.items(), key=lambda g: (long_first(g[1]), -len(g[1])))
    items[:] = [item for _, group in order for item in group]
    if os.environ.get(GROUPS):
        path = Path(os.environ[GROUPS]) / f"{WORKER}.json"
        part = path.with_suffix(".part")
        part.write_text(json.dumps({i.nodeid: name for name, group in order for i in group}))
        os.replace(part, path)  # the controller reads whole files only


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadgroup, with each test's group as the workers wrote it. xdist's own reads the
    group from a suffix it adds to the test's node id, which pytest 9.2's node ids no longer
    take (pytest-dev/pytest-xdist#1386): every test ran on its own."""
    if config.getvalue("dist") != "loadgroup" or not os.environ.get(GROUPS):
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):
        written: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.written is None:  # all workers have collected: their files are complete
                first = min(Path(os.environ[GROUPS]).glob("*.json"))
                self.written = json.loads(first.read_text())
            # a test missing from them carries its group in its node id (older pytest)
            return self.written.get(nodeid) or super()._split_scope(nodeid)

    return GroupScheduling(config, log)
