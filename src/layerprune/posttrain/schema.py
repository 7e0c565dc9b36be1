"""The variant recipe: how to post-train a model that can reason (strict, typed, one section per concern)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from layerprune.core.registry import check_name
from layerprune.tasks.probes import probe_tasks

KINDS = ("sft", "rft", "grpo", "distill")  # each registered by name in posttrain.methods


class Section(BaseModel):
    """Base for recipe sections: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class DataSection(Section):
    """What the variant learns from: probe items from the calibration streams and GSM8K train gold solutions."""

    probes: dict[str, int] = Field(
        default_factory=dict, description="Probe task -> items drawn from its calibration stream (gold answers, in the "
        "few-shot text the probes are scored in); an item whose question or example is an evaluation item of a seed "
        "in exclude_probe_seeds is dropped")
    gsm8k: int = Field(0, ge=0, description="GSM8K train gold solutions ('Question: ...\\nAnswer:'); GSM8K test "
                       "questions are dropped")
    seed: int = Field(0, description="Calibration stream seed of the probe items and shuffle seed of GSM8K rows")
    exclude_probe_seeds: list[int] = Field(
        [0], description="Evaluation probe seeds whose first 500 items per probe task are never trained on")

    @field_validator("probes")
    @classmethod
    def _known_tasks(cls, probes: dict[str, int]) -> dict[str, int]:
        for task, count in probes.items():
            check_name("probe task", task, probe_tasks())
            if count < 1:
                raise ValueError(f"probes.{task}: at least 1 item")
        return probes

    @model_validator(mode="after")
    def _some_data(self) -> DataSection:
        if not self.probes and not self.gsm8k:
            raise ValueError("no data: name probe tasks in data.probes or set data.gsm8k")
        return self


class TrainSection(Section):
    """Optimisation (TRL's SFTTrainer / GRPOTrainer)."""

    method: Literal["full", "lora"] = Field("full", description="Fine-tune every weight (full) or a LoRA adapter "
                                            "merged into the checkpoint at the end (lora)")
    learning_rate: float = Field(5e-5, gt=0, description="Peak learning rate (AdamW)")
    lr_scheduler: str = Field("constant_with_warmup", description="transformers scheduler name")
    warmup_steps: int = Field(0, ge=0, description="Warmup steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm")
    batch_size: int = Field(8, ge=1, description="Sequences per micro-batch")
    grad_accum: int = Field(2, ge=1, description="Micro-batches per optimizer step")
    epochs: float = Field(1.0, gt=0, description="Passes over the data")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs)")
    max_length: int = Field(512, ge=16, description="Longest training sequence in tokens")
    bf16: bool = Field(False, description="bfloat16 mixed precision on a GPU (a CPU always trains in float32)")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory for long sequences or large "
        "models, about a third more compute (TRL's SFT and GRPO turn it on unless told; layerprune does not)")
    logging_steps: int = Field(10, ge=1, description="Training loss every this many steps")
    lora_r: int = Field(16, ge=1, description="LoRA rank (method lora)")
    lora_alpha: float = Field(32, gt=0, description="LoRA alpha (method lora)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (method lora)")

    @field_validator("lr_scheduler")
    @classmethod
    def _known_scheduler(cls, name: str) -> str:
        from transformers import SchedulerType

        return check_name("lr scheduler", name, [s.value for s in SchedulerType])

    def sequences_per_step(self) -> int:
        return self.batch_size * self.grad_accum


class SampleSection(Section):
    """How the model (rft, grpo) or the teacher (distill) answers the problems."""

    k: int = Field(4, ge=1, description="rft: samples per problem; grpo: generations per prompt (at least 2)")
    temperature: float = Field(0.8, ge=0, description="Sampling temperature (distill: greedy whatever this says)")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling top-p")
    max_new_tokens: int = Field(32, ge=1, description="Longest answer in tokens (GSM8K solutions need ~256)")
    batch_size: int = Field(16, ge=1, description="Prompts per generation batch")
    keep_correct: bool = Field(False, description="distill: keep only the teacher's answers the grader marks right "
                               "(rft always does)")


class GrpoSection(Section):
    """GRPO (TRL's GRPOTrainer) with the exact-answer reward of the project's graders."""

    beta: float = Field(0.0, ge=0, description="KL coefficient against the source model (0: no reference model)")
    num_iterations: int = Field(1, ge=1, description="Optimisation passes per generation batch")
    loss_type: str = Field("dapo", description="TRL's GRPO loss_type (grpo, dapo, dr_grpo, bnpo, ...)")


class VariantRecipe(Section):
    """Post-train `model` into a variant: SFT on gold solutions, rejection-sampling FT, GRPO, or distillation."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)
    # `kind:` in a recipe file is the recipe's kind (variant); the method was called `kind` before, so a variant
    # report's recorded recipe still reads, and the fingerprint (dumped by alias) of every variant made is unchanged
    method: str = Field("sft", validation_alias=AliasChoices("method", "kind"), serialization_alias="kind",
                        description="sft (gold solutions), rft (the model's own graded-right samples), grpo "
                        "(exact-answer reward) or distill (the teacher's greedy answers)")
    model: str = Field("embedded", description="Source model: embedded name, directory, .gguf or hub id")
    teacher: str | None = Field(None, description="distill: the stronger model whose answers the variant learns")
    name: str | None = Field(None, description="Label of the cached variant's folder (default: the method)")
    description: str | None = Field(None, description="What the variant is for (shown by `layerprune recipes`)")
    format: Literal["plain", "chat"] = Field(
        "plain", description="plain: the few-shot text the probes are scored in, the answer and its stop ('\\n'); "
        "chat: the examples and question as chat turns through the tokenizer's template")
    data: DataSection = Field(default_factory=lambda: DataSection(probes={"arith_2d_add": 64}))
    train: TrainSection = Field(default_factory=TrainSection)
    sample: SampleSection = Field(default_factory=SampleSection)
    grpo: GrpoSection = Field(default_factory=GrpoSection)

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        return check_name("variant method", method, KINDS)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str | None) -> str | None:
        if name is not None and (not name or any(c in name for c in "/\\ ") or name.startswith(".")):
            raise ValueError("name: letters, digits, '-', '_' and '.' only (a folder name)")
        return name

    @model_validator(mode="after")
    def _teacher_for_distill(self) -> VariantRecipe:
        if self.method == "distill" and not self.teacher:
            raise ValueError("method distill needs a teacher model")
        if self.method != "distill" and self.teacher:
            raise ValueError(f"teacher is read by method distill only, not {self.method}")
        if self.method == "grpo" and self.sample.k < 2:
            raise ValueError("grpo compares several generations per prompt: sample.k at least 2")
        return self
