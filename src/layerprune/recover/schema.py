"""The recover recipe: what to generate and how to fine-tune (strict, typed, one section per concern)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import check_name
from layerprune.tasks.data import HUB_DATASETS, HUB_SOURCE, parse_hub_source
from layerprune.tasks.probes import probe_tasks

M = TypeVar("M", bound=BaseModel)

if TYPE_CHECKING:
    from layerprune.recover.methods import RecoveryMethod

Optimizer = Literal["auto", "adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"]
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
    # then one section per registered method that has one (kd, opd, replace, merge, local: add_section)

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
        for method in self.chain_methods():
            if method.validate is not None:
                method.validate(self)
        if self.train.max_length <= self.generate.max_new_tokens // 4:
            raise ValueError("train.max_length is shorter than a quarter of generate.max_new_tokens")
        return self

    def uses_lora(self) -> bool:
        """Whether training leaves a LoRA adapter."""
        return self.adapter_of(self.trainer_method()) == "lora"

    def chain_methods(self) -> list[RecoveryMethod]:
        """The registered methods of the chain, in order: the recipe's method, then the one its section's `then`
        names where the method changes blocks (one hop: 'replace' then 'local', 'local' then 'kd'...)."""
        from layerprune.recover.methods import METHODS

        first = METHODS.get(self.method)
        then = getattr(getattr(self, first.section), "then", "none") if first.section else "none"
        return [first, METHODS.get(then)] if first.changes_blocks and then != "none" else [first]

    def trainer_method(self) -> str | None:
        """The method whose trainer runs (replace, merge, local: the distillation after them, or None)."""
        return next((m.name for m in self.chain_methods() if not m.changes_blocks), None)

    def surgery_steps(self) -> list[str]:
        """The steps that change blocks before any trainer runs, in order (replace or merge, then local)."""
        return [m.name for m in self.chain_methods() if m.changes_blocks]

    def chain_name(self) -> str:
        """The method chain as the report names it: 'merge+local', 'replace+opd', 'kd'..."""
        trainer = self.trainer_method()
        return "+".join([*self.surgery_steps(), *([trainer] if trainer else [])])

    def lr_section(self) -> str | None:
        """The section whose learning_rate the chain trains at (the first step that trains: 'local' where a local
        step runs, else 'train'), None where no step trains (a fold or merge alone)."""
        return next((m.lr_section for m in self.chain_methods() if m.lr_section is not None), None)

    def needs_cut(self) -> bool:
        """Whether a step changes the blocks around a cut (no k = 0 control: the unpruned model has none)."""
        return any(m.needs_cut for m in self.chain_methods())

    def adapter_of(self, method: str | None) -> str | None:
        """What a method trains (lora, full): its own `adapter`, else its section's `adapter` field (kd, opd)."""
        from layerprune.recover.methods import METHODS

        found = METHODS.get(method) if method in METHODS else None
        if found is None or found.adapter is not None:
            return found.adapter if found else None
        return getattr(getattr(self, found.section), "adapter", None) if found.section else None


def add_section(name: str, model: type[Section]) -> None:
    """Give RecoverRecipe a section `name` of type `model` (a recipe key, `recipe.NAME`, and `--NAME-FIELD` flags),
    defaults where a recipe omits it: how a recovery method owns its section (recover.methods.recovery_method)."""
    if name in RecoverRecipe.model_fields:
        raise ValueError(f"recipe section '{name}' declared twice")
    RecoverRecipe.__pydantic_fields__[name] = FieldInfo.from_annotated_attribute(model, Field(default_factory=model))
    RecoverRecipe.__annotations__[name] = model
    rebuild_recipe()


EMBEDDING: list[type[BaseModel]] = []  # models with a RecoverRecipe field (recover_report.json's): rebuilt with it


def embeds_recipe(model: type[M]) -> type[M]:
    """Register a model that holds a RecoverRecipe field: pydantic copies a field's validator when it builds a model,
    so a section added later would be unknown to it (a recorded recipe read back without its method's section)."""
    EMBEDDING.append(model)
    return model


def rebuild_recipe() -> None:
    """RecoverRecipe and every model embedding it, built again from RecoverRecipe's fields as they are now."""
    RecoverRecipe.model_rebuild(force=True)
    for model in EMBEDDING:
        model.model_rebuild(force=True)


def _has_answers(source: str) -> bool:
    """Whether a source can carry answers (a user's file or hub dataset may: its 'answer' field)."""
    return source in ("gsm8k", "probes") or source.endswith(".jsonl") or source.startswith(("probes:", HUB_SOURCE))


def __getattr__(name: str) -> type[Section]:
    """A registered method's section model by its class name (`from layerprune.recover.schema import KdSection`
    still works: the class lives in the method's own module)."""
    for field in RecoverRecipe.model_fields.values():
        if isinstance(field.annotation, type) and field.annotation.__name__ == name:
            return field.annotation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


import layerprune.recover.methods  # noqa: E402,F401  (every registered method's section, before any recipe is read)
