"""Evaluation through lm-evaluation-harness: offline task mapping, algorithmic probes, HumanEval+ in a sandbox,
cached per-model summaries and the baseline / pruned / recovered comparison.

Public API (imported lazily, so `layerprune --help` stays fast):
    evaluate_model(model, settings, run, output_dir, overwrite) -> Summary
    evaluate_models(roles, settings, run, output, overwrite) -> printed tables
    compare(summaries, output_dir) -> {"table", "rows", "averages", "paths"}
    read_summary(path) -> Summary (a summary.json, checked against the schema)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "evaluate_model": "runner", "evaluate_models": "api", "compare": "report", "format_table": "report",
    "EvalSettings": "schema", "Summary": "summary", "TaskResult": "summary", "read_summary": "summary",
    "describe_suites": "suites", "load_suites": "suites", "plan_tasks": "suites",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'layerprune.evaluate' has no attribute '{name}'")
    return getattr(importlib.import_module(f"layerprune.evaluate.{_EXPORTS[name]}"), name)
