"""The recover recipe: what to generate and how to fine-tune (strict, typed, one section per concern)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import check_name
from layerprune.tasks.data import HUB_DATASETS, HUB_SOURCE, parse_hub_source
from layerprune.tasks.probes import probe_tasks

Optimizer = Literal["auto", "adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"]
SURGERY_METHODS = ("replace", "merge", "local")  # methods that change blocks from the teacher's weights or states
MIRROR_ONLY_PROMPT_SETS = ("alpaca_seed",)  # read by name from the data mirror alone (no hub copy is known)


class Section(BaseModel):
    """Base for recipe sections: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class PromptSource(Section):
    """Where the prompts come from."""

    source: str = Field("gsm8k", description="Prompt set: gsm8k, dolly, alpaca_seed, probes (every probe task, on "
                        "the recovery seed stream), probes:TASK+TASK, a hub dataset hf:OWNER/NAME[:CONFIG], or a "
                        "path to a .jsonl file")
    split: str = Field("train", description="Split of a named prompt set or hub dataset")
    field: str = Field("prompt", description="Prompt field of a .jsonl or hub source (answer field: 'answer', "
                       "optional)")
    samples: int | None = Field(None, ge=1, description="Use at most this many prompts (None: all)")
    shuffle_seed: int = Field(0, description="Seed of the prompt shuffle before taking --samples")
    exclude_probe_seeds: list[int] = Field(
        [0], description="Evaluation probe seeds whose first 500 items per probe task are never used as prompts")

    @field_validator("source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        if source.startswith(HUB_SOURCE):
            try:
                parse_hub_source(source)
            except LayerpruneError as exc:
                raise ValueError(str(exc)) from exc
            return source
        if source.endswith(".jsonl"):
            return source
        if source.startswith("probes:"):
            for task in source.removeprefix("probes:").split("+"):
                check_name("probe task", task.strip(), probe_tasks())
            return source
        return check_name("prompt set", source, [*HUB_DATASETS, *MIRROR_ONLY_PROMPT_SETS, "probes"])


class GenerationSection(Section):
    """How the teacher answers each prompt (stage 1)."""

    system_prompt: str | None = Field("You are a helpful assistant.", description="System message (None: none)")
    temperature: float = Field(0.9, ge=0.0, description="Sampling temperature (0: greedy)")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling top-p")
    max_new_tokens: int = Field(512, ge=1, description="Longest teacher response in tokens")
    batch_size: int = Field(16, ge=1, description="Prompts per generation batch")
    backend: Literal["hf", "vllm"] = Field("hf", description="Generation backend: hf (transformers) or vllm")
    vllm_gpu_memory: float = Field(
        0.5, gt=0, le=0.95, description="vLLM's share of GPU memory (the engine is shut down before training)"
    )
    filter: Literal["none", "correct"] = Field(
        "none", description="Keep every response (none) or only those whose final number is right (correct)"
    )
    max_response_tokens: int | None = Field(None, ge=1, description="Drop responses longer than this (length cap)")
    drop_truncated: bool = Field(True, description="Drop responses cut off at max_new_tokens")
    chat_template: bool = Field(
        True, description="Wrap each prompt in the teacher's chat template (system prompt, user turn) and train every "
        "method in that chat format. false: the teacher continues the plain prompt text, as the probe evaluation "
        "scores few-shot prompts, up to `stop` (the answer is the text before it), and every method trains on the "
        "plain prompt + answer + stop, with no template token and no system prompt")
    stop: str = Field("\n", min_length=1, description="Without the chat template: the string that ends a continuation "
                      "(default: a line break, the probe evaluation's stop)")


class TrainSection(Section):
    """Stage 2 optimisation settings (defaults follow the pruning study)."""

    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate")
    lr_scheduler: str = Field("constant_with_warmup", description="transformers scheduler name")
    warmup_steps: int = Field(50, ge=0, description="Warmup steps")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm")
    optimizer: Optimizer = Field(
        "auto", description="Optimizer (auto: adamw_torch, or 8-bit/paged AdamW when full SFT would not fit the budget)"
    )
    batch_size: int = Field(4, ge=1, description="Per-device micro-batch size")
    grad_accum: int = Field(2, ge=1, description="Gradient accumulation steps")
    epochs: float = Field(1.0, gt=0, description="Training epochs")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs)")
    max_tokens: int | None = Field(None, ge=1, description="Stop once the student has trained on this many target "
                                   "tokens: completion tokens, neither padding nor masked out, the same unit for every "
                                   "method (local: the answer tokens of its sequences, each span's block on the whole "
                                   "budget), whichever of max_steps and max_tokens comes first")
    max_length: int = Field(8192, ge=16, description="Longest training sequence in tokens (prompt + response)")
    bf16: bool = Field(True, description="bfloat16 mixed precision (switched off automatically on a CPU)")
    pure_bf16: bool = Field(
        False, description="Train all weights (full, kd/opd with a full adapter) in pure bfloat16: bf16 weights, "
        "gradients and AdamW states, no float32 master copy. Saves memory, but one AdamW step at a small learning "
        "rate (1e-5) is below half a bf16 step for most weights, so they never change; the report names it. "
        "Default: float32 master weights with bf16 autocast")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in the backward pass")
    held_out: float = Field(0.1, ge=0.0, lt=0.9, description="Fraction of responses held out for the loss curve")
    eval_steps: int = Field(50, ge=1, description="Held-out loss every this many steps")
    logging_steps: int = Field(5, ge=1, description="Training loss every this many steps")
    save_steps: int = Field(100, ge=1, description="Checkpoint every this many steps (for --resume)")

    @field_validator("lr_scheduler")
    @classmethod
    def _known_scheduler(cls, name: str) -> str:
        from transformers import SchedulerType

        return check_name("learning-rate scheduler", name, [kind.value for kind in SchedulerType])


class LoraSection(Section):
    """Flat LoRA settings, mapped onto peft.LoraConfig in one function."""

    r: int = Field(64, ge=1, description="LoRA rank")
    alpha: float = Field(16, gt=0, description="LoRA alpha (scale = alpha / r)")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout")
    target_modules: list[str] | str = Field(
        "all-linear", description="Modules to adapt (all-linear: every linear but lm_head)"
    )
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases to train")

    @field_validator("target_modules")
    @classmethod
    def _split(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, str) and "," in value:
            return [part.strip() for part in value.split(",") if part.strip()]
        return value


class KdSection(Section):
    """Knowledge distillation from the teacher's token distribution (method kd)."""

    temperature: float = Field(1.0, gt=0, description="Softmax temperature of teacher and student")
    weight: float = Field(1.0, ge=0, le=1, description="Loss = weight * forward KL + (1 - weight) * cross-entropy")
    adapter: Literal["lora", "full"] = Field("lora", description="Train LoRA adapters or all weights")


class OpdSection(Section):
    """On-policy distillation (method opd): the student samples, the teacher scores every token."""

    beta: float = Field(1.0, ge=0, le=1, description="Divergence: 0 forward KL, 1 reverse KL, between: generalised JSD")
    lmbda: float = Field(1.0, ge=0, le=1, description="Share of batches on the student's own samples (1: all)")
    max_new_tokens: int = Field(128, ge=1, description="Longest student completion in tokens")
    temperature: float = Field(1.0, gt=0, description="Temperature of the student's samples and of "
                               "the divergence (opd.lmbda < 1, TRL GKD, cannot apply it to the divergence: 1 only)")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus top-p of the student's samples "
                       "(both paths)")
    adapter: Literal["lora", "full"] = Field("lora", description="Train LoRA adapters or all weights")


class ReplaceSection(Section):
    """Training-free block replacement (method replace): one least-squares linear map per dropped run."""

    calib_samples: int = Field(64, ge=1, description="Teacher responses (prompt + answer) used as calibration text")
    max_length: int = Field(512, ge=8, description="Longest calibration sequence in tokens")
    ridge: float = Field(1e-4, ge=0, description="Ridge term, relative to the mean diagonal of the normal equations")
    then: Literal["none", "kd", "opd", "local"] = Field(
        "none", description="After the fold: distil (kd or opd sections apply) or train the folded block locally")


class MergeSection(Section):
    """Layer collapse after LaCo (method merge, arXiv 2402.11187): each dropped span's attention and MLP parameter
    differences added to the kept block before it (RDSC: anchor <- anchor + sum over the span of (block - anchor), the
    source model's weights, norms left as they are), kept only while the mean cosine similarity of the model's last
    hidden states with the teacher's on calibration text stays above the threshold (else that span stays a plain
    drop). Unlike LaCo, the spans are the prune stage's, not found by LaCo's own top-down search."""

    threshold: float = Field(0.65, ge=-1, le=1, description="LaCo's T: a span's merge is kept only if the mean cosine "
                             "similarity of the last hidden states with the teacher's exceeds it (0.65: the paper's "
                             "value for Llama2-7B; -1 keeps every merge, 1 none)")
    calib_samples: int = Field(5, ge=1, description="Teacher responses (prompt + answer) on which the similarity is "
                               "measured (LaCo: 5 sentences)")
    max_length: int = Field(512, ge=8, description="Longest calibration sequence in tokens")
    weight: float = Field(1.0, ge=0, description="Not part of LaCo: per-span weight w of the summed differences (1, "
                          "the default: LaCo's RDSC; 0: plain pruning)")
    span_weights: list[float] | None = Field(None, description="Not part of LaCo: one weight per dropped span, in "
                                             "block order (overrides weight)")
    then: Literal["none", "kd", "opd", "local"] = Field(
        "none", description="After the merge: distil (kd or opd sections apply) or train the merged block locally")

    @field_validator("span_weights")
    @classmethod
    def _non_negative(cls, weights: list[float] | None) -> list[float] | None:
        if weights is not None and (not weights or min(weights) < 0):
            raise ValueError("merge.span_weights must list one weight >= 0 per dropped span")
        return weights


class LocalSection(Section):
    """Span-local training (method local, after LLM-Streamline): per dropped span, only the kept block next to the cut
    learns to map the teacher's hidden state entering it to the teacher's state leaving the span (MSE), on the
    training text (the teacher's answers to the prompts), its states cached one span at a time."""

    block: Literal["before", "after"] = Field(
        "before", description="Train the kept block before the span (input: the teacher's state entering that block, "
        "target: its state after the span) or the one after it (input: the state entering the span, target: the state "
        "after that block)")
    steps: int | None = Field(None, ge=1, description="Optimizer steps, shared out over the spans (default: "
                              "train.max_steps, else one pass over the training text)")
    learning_rate: float | None = Field(None, gt=0, description="AdamW learning rate (default: train.learning_rate)")
    max_length: int = Field(512, ge=8, description="Longest training sequence in tokens")
    then: Literal["none", "kd", "opd"] = Field("none", description="Distil after the local step (kd or opd sections)")


class RecoverRecipe(Section):
    """Self-generated-response fine-tuning of a pruned model (what to do; RunSettings says how)."""

    name: str = Field("custom", description="Recipe name")
    description: str = Field("", description="One line about the recipe")
    model: str | None = Field(None, description="Pruned model directory (or any model spec with drop_blocks)")
    teacher: str | None = Field(None, description="Teacher model (default: the source named in prune_report.json)")
    drop_blocks: list[int] | None = Field(
        None, description="Drop these blocks from --model before recovering (teacher = --model unpruned)"
    )
    method: str = Field("lora", description="lora, qlora (4-bit, CUDA), full, kd or opd (distil the teacher), "
                           "replace (least-squares maps), merge (LaCo: fold each dropped span into the kept block "
                           "before it, kept where the outputs stay similar) or local "
                           "(train the block next to each cut on the teacher's hidden states)")
    prompts: PromptSource = Field(default_factory=PromptSource)
    generate: GenerationSection = Field(default_factory=GenerationSection)
    train: TrainSection = Field(default_factory=TrainSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    kd: KdSection = Field(default_factory=KdSection)
    opd: OpdSection = Field(default_factory=OpdSection)
    replace: ReplaceSection = Field(default_factory=ReplaceSection)
    merge: MergeSection = Field(default_factory=MergeSection)
    local: LocalSection = Field(default_factory=LocalSection)

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        from layerprune.recover.methods import METHODS

        return check_name(METHODS.kind, method, METHODS.names())

    @model_validator(mode="after")
    def _check(self) -> RecoverRecipe:
        if self.generate.filter == "correct" and not _has_answers(self.prompts.source):
            raise ValueError(
                f"generate.filter 'correct' needs prompts with known answers (gsm8k, probes, or a .jsonl or hf: "
                f"source with an 'answer' field), not '{self.prompts.source}'"
            )
        if self.drop_blocks is not None and (not self.drop_blocks or min(self.drop_blocks) < 0):
            raise ValueError("drop_blocks must list block indices >= 0")
        if self.trainer_method() == "opd" and self.opd.lmbda < 1 and self.opd.temperature != 1:
            raise ValueError(
                f"opd.temperature {self.opd.temperature} with opd.lmbda {self.opd.lmbda}: mixed on-policy "
                "distillation (TRL GKD) samples at that temperature but computes its divergence at 1, while the fully "
                "on-policy path applies it to both; use opd.lmbda 1 or opd.temperature 1")
        if self.train.max_length <= self.generate.max_new_tokens // 4:
            raise ValueError("train.max_length is shorter than a quarter of generate.max_new_tokens")
        return self

    def uses_lora(self) -> bool:
        """Whether training leaves a LoRA adapter."""
        return self.method in ("lora", "qlora") or self.adapter_of(self.trainer_method()) == "lora"

    def trainer_method(self) -> str | None:
        """The method whose trainer runs (replace, merge, local: the distillation after them, or None)."""
        if self.method in SURGERY_METHODS:
            then = getattr(self, self.method).then
            return then if then in ("kd", "opd") else None
        return self.method

    def surgery_steps(self) -> list[str]:
        """The steps that change blocks before any trainer runs, in order (replace or merge, then local)."""
        if self.method in ("replace", "merge"):
            return [self.method, "local"] if getattr(self, self.method).then == "local" else [self.method]
        return ["local"] if self.method == "local" else []

    def chain_name(self) -> str:
        """The method chain as the report names it: 'merge+local', 'replace+opd', 'kd'..."""
        trainer = self.trainer_method()
        return "+".join([*self.surgery_steps(), *([trainer] if trainer else [])])

    def adapter_of(self, method: str | None) -> str | None:
        return {"kd": self.kd.adapter, "opd": self.opd.adapter}.get(method or "")


def _has_answers(source: str) -> bool:
    """Whether a source can carry answers (a user's file or hub dataset may: its 'answer' field)."""
    return source in ("gsm8k", "probes") or source.endswith(".jsonl") or source.startswith(("probes:", HUB_SOURCE))
