"""Evaluation through lm-evaluation-harness: offline task mapping, algorithmic probes, HumanEval+ in a sandbox,
cached per-model summaries and the baseline / pruned / recovered comparison."""

from layerprune.evaluate.api import evaluate_models
from layerprune.evaluate.report import compare, format_table
from layerprune.evaluate.runner import evaluate_model
from layerprune.evaluate.schema import EvalSettings, Summary, TaskResult
from layerprune.evaluate.suites import describe_suites, load_suites, plan_tasks

__all__ = ["EvalSettings", "Summary", "TaskResult", "compare", "describe_suites", "evaluate_model",
           "evaluate_models", "format_table", "load_suites", "plan_tasks"]
