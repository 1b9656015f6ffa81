"""The tests' fork server (tests/helpers/forkserver.py) starts `python` children as `python`
would: argv, exit status, streams, working directory, environment, session and threads; its
children count as their launcher's in the process trees that kill_tree walks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import forkserver
from processes import descendants, kill_tree

pytestmark = pytest.mark.skipif(os.environ.get(forkserver.ENV) == "0",
                                reason="the fork server is off (ATOMC_TEST_FORKSERVER=0)")


def _forked(proc: subprocess.Popen) -> bool:
    return getattr(proc, "_forked", None) is not None or proc.pid in forkserver.launchers()


def test_a_script_module_and_code_run_as_python_runs_them(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import os, sys\n"
                      "print(sys.argv, os.getcwd(), os.environ['SEEN'], sys.path[0])\n"
                      "print('to stderr', file=sys.stderr)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    env = {**os.environ, "SEEN": "yes", "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, str(script), "3"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    assert r.stdout == f"{[str(script), '3']} {tmp_path} yes {tmp_path}\n"
    assert r.stderr == "to stderr\n"
    # -m finds a module on PYTHONPATH and runs it as __main__; -u writes at once
    (tmp_path / "mod.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    r = subprocess.run([sys.executable, "-u", "-m", "mod", "a", "b"], cwd="/", env=env,
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "__main__ ['a', 'b']\n")
    # a module the server has imported runs afresh as __main__, without runpy's warning
    r = subprocess.run([sys.executable, "-m", "atomc.cli", "--version"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("atomc") and r.stderr == ""
    # an uncaught exception: its traceback on stderr and status 1, as python gives
    r = subprocess.run([sys.executable, "-c", "raise ValueError('seen')"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().endswith("ValueError: seen")
    # threads as OMP_NUM_THREADS says
    code = "import torch; print(torch.get_num_threads())"
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=60)
    assert r.stdout == "1\n"


def test_a_child_in_a_session_of_its_own_is_killed_with_its_tree() -> None:
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        assert _forked(proc)
        assert os.getpgid(proc.pid) == proc.pid  # its own session and group
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        deadline = time.monotonic() + 30
        while len(descendants(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # its child, forked by the server too, counts as its
        tree = descendants(proc.pid)
        assert len(tree) == 2
    finally:
        kill_tree(proc)
    assert proc.wait(timeout=30) == -9
    assert all(not Path(f"/proc/{p}").exists() or "Z" in Path(f"/proc/{p}/stat").read_text()
               .rsplit(")", 1)[1].split()[0] for p in tree)


def test_what_it_cannot_fork_is_executed() -> None:
    r = subprocess.run([sys.executable, "-S", "-c", "import os; print(os.getppid())"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout == f"{os.getpid()}\n"


def test_a_missing_folder_or_script_fails_as_with_python(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        subprocess.Popen([sys.executable, "-c", "pass"], cwd=tmp_path / "nowhere")
    r = subprocess.run([sys.executable, str(tmp_path / "none.py")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "can't open file" in r.stderr


def test_variables_read_at_start_are_a_fresh_process_s() -> None:
    """glibc reads MALLOC_* when a process starts: a launch that sets one is executed."""
    code = "import os; print(os.getppid())"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout == f"{os.getpid()}\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout != f"{os.getpid()}\n"  # forked: the server is its parent
