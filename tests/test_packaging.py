"""A non-editable install works outside the checkout: templates and profiles ship inside."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_templates_and_profiles(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(wheels)],
                   check=True, capture_output=True)
    site = tmp_path / "site"
    (wheel,) = wheels.glob("atomc-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(site), str(wheel)], check=True, capture_output=True)
    expected_templates = sorted(p.name for p in (ROOT / "templates").glob("*.jinja"))
    probe = (
        "import atomc, importlib.resources as r\n"
        "from atomc.profile.hardware import hardware_names, load_hardware\n"
        "assert 'site' in atomc.__file__, atomc.__file__\n"
        "print(','.join(hardware_names()))\n"
        "print(load_hardware('v100-32gb').memory_bytes)\n"
        "print(','.join(sorted(p.name for p in r.files('atomc.templates').iterdir() "
        "if p.name.endswith('.jinja'))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert "v100-32gb" in out[0].split(",") and "h100-80gb" in out[0].split(",")
    assert int(out[1]) == 32 * 2**30
    assert (out[2].split(",") if out[2] else []) == expected_templates
