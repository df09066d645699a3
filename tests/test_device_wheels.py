"""The GPU run's wheel plan (tools/device/device_wheels.py) keeps up with the project: a
dependency added to pyproject.toml, or a module the run newly imports, that is neither
pinned in tools/device/device_wheels.txt nor in the lent machine's image fails here, before
a device call finds it. No download: the pins and pyproject.toml are read as they stand."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("device_wheels", ROOT / "tools" / "device" / "device_wheels.py")
wheels = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(wheels)


def test_every_dependency_in_pyproject_is_pinned_for_the_gpu_run_or_in_its_image():
    needs = dict.fromkeys(wheels.project_needs(), "llm-mlx-streaming")
    assert "prometheus-client" in {wheels.canonical(line.split(";")[0].strip()) for line in needs}
    assert wheels.unmet(needs, set(wheels.pins())) == []


def test_a_need_that_is_neither_pinned_nor_in_the_image_is_named_unless_its_marker_excludes_linux():
    needs = {"left-pad>=1": "x", "mlx-metal; sys_platform == 'darwin'": "y", "mlx[cpu]; sys_platform == 'linux'": "z",
             "llm>=0.36": "z", "numpy": "z", "llguidance": "z"}
    assert wheels.unmet(needs, set(wheels.pins())) == ["left-pad>=1 (for x)"]


def test_every_module_the_gpu_run_imports_comes_from_a_pinned_wheel_the_image_or_the_stdlib():
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "device" / "device_wheels.py"), "--plan"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "imports: what device_bench" in run.stdout
