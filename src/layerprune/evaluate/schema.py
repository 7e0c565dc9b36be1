"""Evaluation settings: what to evaluate and how (suites, per-kind and per-task settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import check_name


class TaskSettings(BaseModel):
    """Settings a suite gives a kind of task or one task."""

    model_config = ConfigDict(extra="forbid")

    limit: float | None = Field(None, gt=0)
    num_fewshot: int | None = Field(None, ge=0)
    max_gen_toks: int | None = Field(None, ge=1)


class Suite(BaseModel):
    """A named list of tasks (or other suites) with settings per task kind and per task."""

    model_config = ConfigDict(extra="forbid")

    description: str
    tasks: list[str] = Field(min_length=1)
    classification: TaskSettings = TaskSettings()
    generative: TaskSettings = TaskSettings()
    overrides: dict[str, TaskSettings] = {}


class EvalSettings(BaseModel):
    """What to evaluate and how."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[str] | None = Field(None, description="Comma-separated tasks (see --list), or any task, group or "
                                                      "tag lm-eval knows (lm-eval ls tasks)")
    include_path: Path | None = Field(None, description="A folder of your own lm-eval task YAMLs, as lm-eval's "
                                                       "--include_path: --tasks then knows their tasks and groups")
    suite: str | None = Field(
        None, description="A suite of tasks (see --list); default: quick when --tasks is not given"
    )
    only: list[str] | None = Field(None, description="Of the suite's tasks, evaluate only these (the suite's settings "
                                                     "still apply)")
    limit: float | None = Field(None, description="Documents per task: a count, or a fraction of the set if below 1")
    num_fewshot: int | None = Field(None, description="Few-shot examples for lm-eval tasks (default: the task's own)")
    fewshot_from_eval_split: bool = Field(
        False,
        description="Where the few-shot pool lm-eval uses (its training split, fewshot_split or validation) "
        "is missing locally, draw the examples from the scored split (never a document itself)",
    )
    max_gen_toks: int | None = Field(None, ge=1, description="Most tokens generated per answer (generative tasks)")
    batch_size: str = Field("auto", description="Batch size: a number, or auto (32 on CPU, lm-eval's search on GPU)")
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto", description="Apply the model's chat template: auto = for tasks whose protocol calls for it"
    )
    backend: Literal["hf", "vllm", "llamacpp"] = Field(
        "hf", description="lm-eval backend: hf (in-process model), vllm, or llamacpp (a .gguf file scored by llama.cpp "
        "itself, in process: quantized and deci exports as llama.cpp runs them)")
    data_dir: Path | None = Field(
        None,
        description="Local data mirror DIR/<dataset>/<split>.jsonl (default $LAYERPRUNE_DATA_DIR or ../shared/data)",
    )
    probe_seed: int = Field(0, description="Seed the algorithmic probes are generated from")
    probe_format: Literal["plain", "chat"] = Field(
        "plain",
        description="How the probes are asked: plain = the few-shot examples and the question as one text (as "
        "--chat-template says); chat = through the model's chat template, each example a user turn and an "
        "assistant turn, then the question (lm-eval's fewshot_as_multiturn)",
    )
    sandbox_timeout: float = Field(
        60.0,
        gt=0,
        description="Most seconds one HumanEval+ program may run in all "
        "(EvalPlus's per-task cap); each input gets max(1 s, 4 x the reference's time)",
    )
    sandbox_memory_mb: int = Field(2048, ge=64, description="Address-space limit of each HumanEval+ program (MB)")
    samples_per_task: int | None = Field(
        None,
        ge=1,
        description="Also sample N completions per document and report pass@k (k = 1, and 10 where "
        "N >= 10), and maj@N for GSM8K and the probes, next to the greedy scores",
    )
    temperature: float | None = Field(
        None, gt=0, description="Sampling temperature with --samples-per-task (default 0.2, as lm-eval's sampled tasks)"
    )
    reference_solutions: bool = Field(
        False,
        description="Score HumanEval+'s canonical solutions instead of a "
        "model's completions: checks the machine and the harness (expect 1.0)",
    )
    unsafe_code_exec: bool = Field(
        False,
        description="Run generated code even where no isolation is available (not root and no user namespaces): unsafe",
    )
    reuse: bool = Field(True, description="Reuse cached results for the same model, task and settings")
    allow_overlap: bool = Field(
        False,
        description="Evaluate even when evaluated documents are among the pruned "
        "model's calibration items (recorded in the results)",
    )

    @field_validator("limit")
    @classmethod
    def _positive_limit(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("--limit must be above 0 (a count, or a fraction below 1)")
        if value is not None and value >= 1 and value != int(value):
            raise ValueError("--limit of 1 or more must be a whole number of documents")
        return value

    @field_validator("num_fewshot")
    @classmethod
    def _fewshot(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError("--num-fewshot must be 0 or more")
        return value

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, value: str) -> str:
        if value != "auto" and not (value.isdigit() and int(value) > 0):
            raise ValueError("--batch-size must be a positive number or auto")
        return value

    @field_validator("suite")
    @classmethod
    def _known_suite(cls, suite: str | None) -> str | None:
        from layerprune.evaluate.suites import load_suites

        return None if suite is None else check_name("suite", suite, load_suites())

    @model_validator(mode="after")
    def _known_tasks(self) -> EvalSettings:
        """Every task resolves as `evaluate` resolves it (with --include-path, so a model-level check)."""
        from layerprune.evaluate.suites import task_name_error

        errors = [error for name in self.tasks or [] if (error := task_name_error(name, self.include_path))]
        if errors:
            detail = InitErrorDetails(
                type=PydanticCustomError("unknown_task", "{error}", {"error": errors[0]}),
                loc=("tasks",),
                input=self.tasks,
            )
            raise ValidationError.from_exception_data(type(self).__name__, [detail])
        return self


def parse_task_list(value: str | list[str] | None) -> list[str] | None:
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else value
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise LayerpruneError("--tasks is empty")
    return names
