"""layerprune: make decoder-only LLMs shallower and measure what it costs.

The Python entry points, one per command (imported on first use, so `import layerprune` stays light):
    prune_model(model, PruneRecipe(...), RunSettings(...), output)        -> PruneResult   (layerprune prune)
    recover_model(RecoverRecipe(...), RecoverJob(output, settings))       -> report dict   (layerprune recover)
    evaluate_model(model, EvalSettings(...), RunSettings(...), output_dir) -> Summary      (layerprune evaluate)
    run_pipeline(load_run_recipe(name_or_path), RunSettings(...))         -> report.md     (layerprune run)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "prune_model": "layerprune.prune.api",
    "recover_model": "layerprune.recover.runner",
    "evaluate_model": "layerprune.evaluate.runner",
    "run_pipeline": "layerprune.pipeline.stages",
    "PruneRecipe": "layerprune.prune.recipe",
    "RecoverRecipe": "layerprune.recover.schema",
    "RecoverJob": "layerprune.recover.job",
    "EvalSettings": "layerprune.evaluate.schema",
    "load_run_recipe": "layerprune.pipeline.plan",
    "RunSettings": "layerprune.core.settings",
}
__all__ = ["EvalSettings", "PruneRecipe", "RecoverJob", "RecoverRecipe", "RunSettings", "__version__", "evaluate_model",
           "load_run_recipe", "prune_model", "recover_model", "run_pipeline"]

if TYPE_CHECKING:
    __version__: str
    from layerprune.core.settings import RunSettings
    from layerprune.evaluate.runner import evaluate_model
    from layerprune.evaluate.schema import EvalSettings
    from layerprune.pipeline.plan import load_run_recipe
    from layerprune.pipeline.stages import run_pipeline
    from layerprune.prune.api import prune_model
    from layerprune.prune.recipe import PruneRecipe
    from layerprune.recover.job import RecoverJob
    from layerprune.recover.runner import recover_model
    from layerprune.recover.schema import RecoverRecipe


def __getattr__(name: str) -> Any:
    if name == "__version__":  # from the distribution's metadata, asked on first use (layerprune.core.version)
        from layerprune.core.version import package_version

        return package_version()
    if name not in _EXPORTS:
        raise AttributeError(f"module 'layerprune' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, "__version__"})
