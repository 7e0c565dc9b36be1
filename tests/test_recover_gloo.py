"""recover on the real embedded SmolLM2-135M as two CPU processes over gloo, launched with the shipped DDP config.

A module of its own (slow: minutes): pytest-xdist (--dist loadfile) schedules the modules with the fewest tests
last, so the long one-test modules are shared out between the workers at the end instead of running one after
the other on one worker while the other idles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SMALL_DEMO

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_recipe_as_two_cpu_processes_over_gloo(shared_data, tmp_path):
    out = tmp_path / "demo-ddp"
    config = ROOT / "src" / "layerprune" / "accelerate" / "ddp-cpu.yaml"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "-m",
        "layerprune.cli",
        "recover",
        *SMALL_DEMO,
        "--samples",
        "8",
        "--max-steps",
        "2",
        "--data-dir",
        str(shared_data),
        "-o",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "recover_report.json").read_text())
    assert report["data"]["steps"] == 2 and (out / "model.safetensors").is_file()
