"""What each `analyze` subcommand does (strict pydantic schemas; their descriptions are the CLI help)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from layerprune.analyze.tasks import ANALYSIS_TASKS
from layerprune.core.registry import check_name

DEFAULT_MODELS = ["embedded", "embedded:gemma3-270m"]


class OutputOptions(BaseModel):
    """Where results go."""

    model_config = ConfigDict(extra="forbid")

    output: Path | None = Field(None, description="Output directory (default analysis/<subcommand>)")
    overwrite: bool = Field(False, description="Replace the output directory if it exists")
    data_dir: Path | None = Field(None, description="Local data mirror "
                                                    "(default $LAYERPRUNE_DATA_DIR or ../shared/data)")


class Decoding(BaseModel):
    """How one model is prompted and decodes in `--metric generate` (unset fields take the analysis-wide value)."""

    model_config = ConfigDict(extra="forbid")

    chat_template: Literal["auto", "on", "off"] | None = Field(
        None, description="As evaluate's --chat-template: auto = gsm8k and triviaqa through the model's chat "
                          "template when it has one; on = every task; off = raw prompts")
    instruction: str | None = Field(None, description="Text added after each question (e.g. the R1-style 'Please "
                                                      "reason step by step, and put your final answer within "
                                                      "\\boxed{}.')")
    max_new_tokens: int | None = Field(None, ge=1, description="Tokens generated per answer (default: the task's)")
    temperature: float | None = Field(None, ge=0, description="0: greedy; above 0: sampled, seeded by --seed")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling when temperature > 0")


ImportanceMetric = Literal["nll", "accuracy", "generate"]


class ImportanceAnalysis(OutputOptions):
    """Per-block ablation drops for several models and tasks, compared across both."""

    models: list[str] = Field(default_factory=lambda: list(DEFAULT_MODELS),
                              description="Models to compare: hub ids, local dirs, .gguf files or embedded[:name] "
                                          "(default: embedded embedded:gemma3-270m)")
    tasks: list[str] = Field(default_factory=lambda: ["arithmetic", "factual"],
                             description="Tasks (space/comma-separated): arithmetic, gsm8k (train), "
                                         "factual (capitals), triviaqa")
    metric: ImportanceMetric = Field(
        "nll", description="nll: answer-token probability exp(-NLL); accuracy: teacher-forced exact match (every "
                           "answer token is the argmax); both reuse the prefix (fast); generate: greedy generation "
                           "exact match, one generation per skipped block (slow; for gsm8k-style answers)")
    samples: int = Field(16, ge=1, description="Items per task")
    shots: int = Field(1, ge=0, description="Few-shot examples per prompt (arithmetic, factual, triviaqa)")
    threshold: float = Field(0.2, gt=0, description="Relative drop above which a block is critical (when the drop "
                                                    "is also significant)")
    alpha: float = Field(0.05, gt=0, lt=1, description="A drop is significant when the lower end of its paired "
                                                         "bootstrap (1 - alpha) interval is above 0")
    resamples: int = Field(1000, ge=100, description="Bootstrap resamples of the items per drop")
    min_base_score: float = Field(0.05, ge=0, description="Below this full-model score the drops are undefined "
                                                           "(reported as null, no critical blocks), not 0")
    batch_size: int = Field(16, ge=1, description="Sequences per forward")
    max_length: int = Field(512, ge=8, description="Longest sequence in tokens (prompts are cut from the left)")
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto", description="--metric generate: as evaluate's --chat-template (auto = gsm8k and triviaqa through "
                            "the model's chat template when it has one; on = every task; off = raw prompts)")
    max_new_tokens: int | None = Field(None, ge=1, description="--metric generate: tokens per answer (default: the "
                                                               "task's, 192 for gsm8k)")
    temperature: float = Field(0.0, ge=0, description="--metric generate: 0 = greedy; above 0 = sampled, every "
                                                      "variant with the same --seed")
    top_p: float = Field(1.0, gt=0, le=1, description="--metric generate: nucleus sampling when temperature > 0")
    per_model: dict[str, Decoding] = Field(default_factory=dict,
                                           description="Recipe only: prompt/decoding overrides per entry of models")
    dry_run: bool = Field(False, description="Print each model's rendered prompt (from its tokenizer), decoding and "
                                             "token budget per task and stop: no weights, no output")
    tokenizers: dict[str, Path] = Field(default_factory=dict,
                                        description="--dry-run: MODEL=DIR, a local tokenizer directory for a model "
                                                    "(else the hub or its cache)")

    @field_validator("models", "tasks")
    @classmethod
    def _not_empty(cls, value: list[str]) -> list[str]:
        value = [v for v in value if v]
        if not value:
            raise ValueError("needs at least one entry")
        if len(set(value)) != len(value):
            raise ValueError(f"lists an entry twice: {value}")
        return value

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        return [check_name(ANALYSIS_TASKS.kind, task, ANALYSIS_TASKS.names()) for task in tasks]

    @field_validator("metric", mode="before")
    @classmethod
    def _known_metric(cls, metric: Any) -> Any:
        return check_name("metric", metric, get_args(ImportanceMetric)) if isinstance(metric, str) else metric

    @field_validator("tokenizers", mode="before")
    @classmethod
    def _model_equals_dir(cls, value: Any) -> Any:
        """The CLI's list of MODEL=DIR as a mapping (a recipe's mapping passes as it is)."""
        if not isinstance(value, list):
            return value
        pairs = {}
        for entry in value:
            model, sep, directory = str(entry).rpartition("=")
            if not sep or not model or not directory:
                raise ValueError(f"'{entry}' is not MODEL=DIR")
            pairs[model] = directory
        return pairs

    @model_validator(mode="after")
    def _per_model_names_models(self) -> ImportanceAnalysis:
        for field in ("per_model", "tokenizers"):
            unknown = sorted(set(getattr(self, field)) - set(self.models))
            if unknown:
                raise ValueError(f"{field} names {unknown}, which are not in models {self.models}")
        return self

    def decoding(self, model: str) -> Decoding:
        """The analysis-wide decoding with `per_model[model]`'s fields over it."""
        base = Decoding(chat_template=self.chat_template, max_new_tokens=self.max_new_tokens,
                        temperature=self.temperature, top_p=self.top_p)
        override = self.per_model.get(model)
        return base.model_copy(update=override.model_dump(exclude_none=True)) if override else base


class NmiAnalysis(OutputOptions):
    """NMI between each block's token clusters and the embedding layer's clusters."""

    model: str = Field("embedded", description="Model: hub id, local dir, .gguf file or embedded[:name]")
    calib: str = Field("gsm8k", description="Calibration task whose texts give the tokens: "
                                            "arithmetic, gsm8k, factual, triviaqa")
    samples: int = Field(8, ge=1, description="Calibration texts")
    min_tokens: int = Field(0, ge=0, description="Take more calibration texts than --samples until there are at "
                                                 "least this many tokens (the study used >= 10000)")
    k: int = Field(16, ge=2, description="k-means clusters per block")
    seeds: int = Field(3, ge=2, description="k-means seeds per state besides the reference's: NMI/AMI are their "
                                            "mean, their agreement with each other is the clustering noise")
    normalize: bool = Field(True, description="Cluster unit-length hidden states (cosine geometry) instead of raw ones")
    pos: bool = Field(True, description="Also compare each block's clusters with the tokens' part-of-speech groups "
                                        "(TextBlob's offline Brill tagger, in the analyze extra; skipped, and said, "
                                        "when it is not installed)")
    threshold: float = Field(0.2, gt=0, description="Relative drop (of answer-token probability on the calibration "
                                                    "texts) above which a block is marked critical")
    ablation_samples: int = Field(2, ge=0, description="Calibration texts used to find the critical blocks by "
                                                       "skipping each block (0: none marked)")
    critical_from: Path | None = Field(None, description="Take the critical blocks from this `analyze importance` "
                                                         "importance.json instead (same model label)")
    critical_task: str | None = Field(None, description="Task of --critical-from to use (default: its first task)")
    batch_size: int = Field(8, ge=1, description="Sequences per forward")
    max_length: int = Field(256, ge=8, description="Longest sequence in tokens")

    @field_validator("calib")
    @classmethod
    def _known_calib(cls, calib: str) -> str:
        return check_name(ANALYSIS_TASKS.kind, calib, ANALYSIS_TASKS.names())


class DegenerationAnalysis(OutputOptions):
    """Repetition and self-similarity of responses, per model or generations file."""

    generations: list[Path] = Field(default_factory=list,
                                    description="JSONL files with prompt and output fields (one per model variant)")
    models: list[str] = Field(default_factory=list,
                              description="Or: models to generate with, e.g. original, pruned, recovered")
    labels: list[str] = Field(default_factory=list, description="Comma-separated names for the files/models, in order")
    prompt_field: str = Field("prompt", description="Field holding the prompt in the generations files")
    output_field: str = Field("output", description="Field holding the response in the generations files")
    prompts: str = Field("alpaca_eval", description="Prompts for on-the-fly generation: a data-mirror folder "
                                                    "(first split found) with an instruction/question/prompt field")
    samples: int = Field(8, ge=1, description="Prompts to generate from (on-the-fly only)")
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per response (greedy)")
    batch_size: int = Field(8, ge=1, description="Prompts per generate call")


class SweepsAnalysis(OutputOptions):
    """Sweeps of one model and one cut (the same pruned weights) that recovered differently, compared arm by arm."""

    runs: list[Path] = Field(..., min_length=1,
                             description="Sweep study folders (each with its sweep.json; one: its figures again, e.g. "
                                         "over tasks scored after it); the first gives the original and pruned "
                                         "models, the others must hold the same ones")
    own_models: bool = Field(False, description="Measure each arm against its own run's original and pruned models "
                                                "(runs of one recipe whose weights differ, e.g. made on two machines); "
                                                "their difference is then in every comparison across runs")
