"""A non-editable install works outside the checkout: every module imports, templates and
profiles ship inside, and the installed console script runs the whole chain."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a wheel built and installed, the chain run in processes


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout, installed into a fresh target folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools reuses the checkout's build/ folder, where a module deleted
    # since the last build would still be found and shipped. Virtual environments (.venv, the
    # survey's .venv-tv: gigabytes) and caches stay behind.
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "*.egg-info", "__pycache__", "out", ".*_cache", ".hypothesis"))
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(wheels)],
                   check=True, capture_output=True)
    site = tmp / "site"
    (wheel,) = wheels.glob("atomc-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(site), str(wheel)], check=True, capture_output=True)
    # The checkout must not be importable. The test environment may hold an editable install of
    # atomc, whose .pth file adds a finder that serves modules from the checkout; `python -S`
    # processes no .pth files, so only the wheel's atomc and the environment's dependencies
    # (their folders put on the path by hand) are seen.
    deps = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *deps])}
    return site, env


def _run(args, env, cwd, timeout=300):
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_every_module_imports_from_the_wheel(installed, tmp_path):
    _, env = installed
    probe = (
        "import importlib, pkgutil, atomc\n"
        "assert 'site' in atomc.__file__, atomc.__file__\n"
        "names = [m.name for m in pkgutil.walk_packages(atomc.__path__, 'atomc.')\n"
        "         if not m.name.endswith('.__main__')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(','.join(names))\n"
    )
    out = _run(["-c", probe], env, tmp_path)
    assert out.returncode == 0, out.stderr
    expected = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "atomc").rglob("*.py") if p.name != "__main__.py"
    } - {"atomc"}
    # every module of the checkout but a __main__ (importing it runs the CLI) is in the wheel
    assert expected <= set(out.stdout.strip().split(",")), expected


def test_wheel_ships_templates_and_profiles(installed, tmp_path):
    _, env = installed
    expected_templates = sorted(p.name for p in (ROOT / "templates").glob("*.jinja"))
    probe = (
        "import importlib.resources as r\n"
        "from atomc.profile.hardware import hardware_names, load_hardware\n"
        "print(','.join(hardware_names()))\n"
        "print(load_hardware('v100-32gb').memory_bytes)\n"
        "print(','.join(sorted(p.name for p in r.files('atomc.templates').iterdir() "
        "if p.name.endswith('.jinja'))))\n"
    )
    out = _run(["-c", probe], env, tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "v100-32gb" in lines[0].split(",") and "h100-80gb" in lines[0].split(",")
    assert int(lines[1]) == 32 * 2**30
    assert (lines[2].split(",") if lines[2] else []) == expected_templates


def test_installed_console_script_runs_the_chain(installed, tmp_path):
    site, env = installed
    atomc = site / "bin" / "atomc"
    assert atomc.exists(), sorted(p.name for p in (site / "bin").iterdir())
    model = tmp_path / "gpt.py"
    shutil.copy(ROOT / "examples" / "gpt.py", model)
    steps = [
        ["--help"],
        ["profile", str(model), "--config", "tiny", "--batch-size", "2", "--seq-len", "16",
         "--device", "cpu", "-o", "tiny.profile.json"],
        ["partition", "tiny.profile.json", "--gpu-mem", "64MiB", "--reserve", "0",
         "-o", "plan.json"],
        ["codegen", "plan.json", "-o", "generated"],
        ["train", "generated", "--steps", "2", "--device", "cpu"],
    ]
    for args in steps:
        out = _run([str(atomc), *args], env, tmp_path)
        assert out.returncode == 0, f"atomc {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    assert (tmp_path / "generated" / "__init__.py").exists()
