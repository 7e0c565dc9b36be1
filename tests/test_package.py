"""`import layerprune` is light, and its entry points resolve on first use."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ENTRY_POINTS = {"prune_model": "layerprune.prune.api", "recover_model": "layerprune.recover.runner",
                "evaluate_model": "layerprune.evaluate.runner", "run_pipeline": "layerprune.pipeline.stages"}


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(SRC)})


def test_import_layerprune_loads_neither_torch_nor_transformers():
    done = python("import layerprune, sys; heavy = [m for m in ('torch', 'transformers', 'lm_eval') "
                  "if m in sys.modules]; assert not heavy, heavy; print(sorted(layerprune.__all__))")
    assert done.returncode == 0, done.stderr
    assert set(ENTRY_POINTS) <= set(ast.literal_eval(done.stdout))


@pytest.mark.parametrize("name, module", ENTRY_POINTS.items())
def test_entry_points_resolve_to_the_stage_functions(name, module):
    import importlib

    import layerprune

    function = getattr(layerprune, name)
    assert callable(function) and function is getattr(importlib.import_module(module), name)
    assert name in dir(layerprune)


def test_unknown_names_and_subpackages():
    import layerprune
    from layerprune import evaluate, prune  # the subpackages, not entry points

    assert prune.__name__ == "layerprune.prune" and evaluate.__name__ == "layerprune.evaluate"
    with pytest.raises(AttributeError, match="prune_modle"):
        layerprune.prune_modle  # noqa: B018
