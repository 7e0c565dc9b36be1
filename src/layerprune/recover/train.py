"""Stage 2: fine-tune the pruned model on the teacher's responses with TRL (LoRA, QLoRA, full or KD)."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models.train_log import LossLogCallback
from layerprune.recover.schema import GenerationSection, LoraSection, RecoverRecipe
from layerprune.recover.selfgen import chat_messages, plain_example

if TYPE_CHECKING:
    from layerprune.recover.methods.kd import KdSection

log = logging.getLogger(__name__)
TRAINING_RECORD = "training.json"  # beside the trainer folder: the seed its checkpoints were made under


class NonFiniteLossError(LayerpruneError):
    """The training loss became NaN or infinite."""


def lora_config(section: LoraSection) -> Any:
    """Map the recipe's flat LoRA section onto peft.LoraConfig."""
    from peft import LoraConfig

    return LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=section.target_modules, bias=section.bias, task_type="CAUSAL_LM")


def quantization_config() -> Any:
    """4-bit NF4 with double quantization (QLoRA); bf16 compute."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def to_dataset(rows: list[dict[str, Any]], settings: GenerationSection, tokenizer: Any, max_length: int) -> Any:
    """Prompt-completion conversations (TRL computes the loss on the completion only); with generate.chat_template
    false, plain prompt + answer + stop, tokenized here (TRL would append the end-of-sequence token, a template
    token, to a plain completion) with the completion mask TRL reads."""
    from datasets import Dataset

    if not settings.chat_template:
        encoded = [plain_example(tokenizer, r["prompt"], r["response"], settings, max_length) for r in rows]
        return Dataset.from_list(
            [{"input_ids": ids, "completion_mask": [0] * start + [1] * (len(ids) - start)} for ids, start in encoded]
        )
    return Dataset.from_list(
        [
            {
                "prompt": chat_messages(row["prompt"], settings.system_prompt),
                "completion": [{"role": "assistant", "content": row["response"]}],
            }
            for row in rows
        ]
    )


def longest_example(tokenizer: Any, rows: list[dict[str, Any]], settings: GenerationSection) -> int:
    """Tokens of the longest prompt + response conversation, as the trainer will see it (before truncation)."""
    if not settings.chat_template:
        return max(
            (len(plain_example(tokenizer, r["prompt"], r["response"], settings, 1 << 30)[0]) for r in rows), default=1
        )
    lengths = [
        len(
            tokenizer.apply_chat_template(
                [
                    *chat_messages(row["prompt"], settings.system_prompt),
                    {"role": "assistant", "content": row["response"]},
                ],
                tokenize=True,
                return_dict=False,
            )
        )
        for row in rows
    ]
    return max(lengths, default=1)


def trains_all_weights(recipe: RecoverRecipe) -> bool:
    """Whether the optimizer updates every weight (full SFT, or kd/opd with a full adapter, after replace too)."""
    return recipe.adapter_of(recipe.trainer_method()) == "full"


def master_fp32(recipe: RecoverRecipe, settings: RunSettings) -> bool:
    """Whether the student is trained from float32 master weights although the run's dtype is 16-bit: every weight
    trained and no train.pure_bf16 opt-in (the trainer's bf16 autocast keeps the matmuls in bf16 on CUDA)."""
    return trains_all_weights(recipe) and not recipe.train.pure_bf16 and settings.resolved_dtype() != torch.float32


def student_settings(recipe: RecoverRecipe, settings: RunSettings) -> RunSettings:
    """The settings the student is loaded for training with: float32 where master_fp32 says so (a bf16 AdamW step
    of 1e-5 rounds away on most weights), the run's own otherwise."""
    return settings.model_copy(update={"dtype": "float32"}) if master_fp32(recipe, settings) else settings


def pure_bf16_note(recipe: RecoverRecipe, settings: RunSettings) -> str | None:
    """The report's line when all weights train in 16 bits with no float32 master copy (train.pure_bf16)."""
    if trains_all_weights(recipe) and settings.resolved_dtype() != torch.float32 and recipe.train.pure_bf16:
        return (f"train.pure_bf16: all weights trained in {settings.resolved_dtype()} with no float32 master copy "
                "(updates below half a 16-bit step are lost)")
    return None


def bf16_allowed(recipe: RecoverRecipe, device: torch.device) -> bool:
    """bf16 mixed precision only where it helps (CUDA with bf16 support); say so when it is switched off."""
    if not recipe.train.bf16:
        return False
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return True
    log.warning("bf16 switched off: %s has no bf16 training support here; training in float32", device.type)
    return False


def training_arguments(
    recipe: RecoverRecipe,
    output_dir: Path,
    device: torch.device,
    optimizer: str,
    seed: int,
    has_eval: bool = False,
    eval_on_start: bool = True,
) -> dict[str, Any]:
    """TrainingArguments fields from the recipe's train section, shared by SFT and every distillation trainer."""
    train = recipe.train
    return dict(
        output_dir=str(output_dir),
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_scheduler,
        warmup_steps=train.warmup_steps,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        optim=optimizer,
        per_device_train_batch_size=train.batch_size,
        per_device_eval_batch_size=train.batch_size,
        gradient_accumulation_steps=train.grad_accum,
        num_train_epochs=train.epochs,
        max_steps=train.max_steps or -1,
        bf16=bf16_allowed(recipe, device),
        gradient_checkpointing=train.gradient_checkpointing,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=train.eval_steps,
        eval_on_start=has_eval and eval_on_start,
        logging_steps=train.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=train.save_steps,
        save_total_limit=2,
        report_to="none",
        seed=seed,
        use_cpu=device.type == "cpu",
        disable_tqdm=True,
        dataloader_num_workers=0,
        include_num_input_tokens_seen="all",
        train_sampling_strategy="sequential",  # the data comes in budget.order: every method sees the same sequences
    )


def sft_config(
    recipe: RecoverRecipe,
    output_dir: Path,
    device: torch.device,
    optimizer: str,
    seed: int,
    has_eval: bool,
    eval_on_start: bool = True,
) -> Any:
    """TRL's SFTConfig from the recipe's train section.

    The held-out loss before training is the trainer's own evaluation at step 0 (`eval_on_start`: inside train(),
    where FSDP2 has prepared the model); it is kept in the checkpoints' log history, so a resumed run does not
    evaluate again.
    """
    from trl import SFTConfig

    return SFTConfig(
        **training_arguments(recipe, output_dir, device, optimizer, seed, has_eval, eval_on_start),
        max_length=recipe.train.max_length,
        completion_only_loss=True,
        packing=False,
        model_init_kwargs=None,
    )


def make_trainer(
    recipe: RecoverRecipe, model: Any, tokenizer: Any, args: Any, train_set: Any, eval_set: Any, teacher: Any = None
) -> Any:
    """SFTTrainer (or the KD subclass) with the LoRA config when the method uses adapters."""
    peft_config = lora_config(recipe.lora) if recipe.uses_lora() else None
    cls = _trainer_classes()["kd" if recipe.method == "kd" else "sft"]
    kwargs = {"teacher": teacher, "kd": recipe.kd} if recipe.method == "kd" else {}
    from transformers.trainer_callback import PrinterCallback

    trainer = cls(
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[LossLogCallback()],
        **kwargs,
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def _trainer_classes() -> dict[str, type]:
    from trl import SFTTrainer

    class GuardedSFTTrainer(SFTTrainer):
        """SFTTrainer that stops on a non-finite loss before it reaches the weights."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[override]
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            check_finite(loss[0] if isinstance(loss, tuple) else loss, self.state.global_step, self.args.output_dir)
            return loss

    class KDTrainer(GuardedSFTTrainer):
        """Forward KL to the teacher's token distribution on the completion tokens (eval loss stays cross-entropy)."""

        def __init__(self, *args: Any, teacher: Any, kd: KdSection, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.teacher, self.kd = teacher, kd

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[override]
            if not model.training:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = distillation_loss(model, self.teacher, inputs, self.kd, num_items_in_batch)
            if num_items_in_batch is not None and self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes  # DDP averages gradients; the count is global
            check_finite(loss, self.state.global_step, self.args.output_dir)
            return loss

    return {"sft": GuardedSFTTrainer, "kd": KDTrainer}


def distillation_loss(
    student: Any, teacher: Any, inputs: dict[str, Any], kd: KdSection, num_items_in_batch: Any = None
) -> torch.Tensor:
    """weight * KL(teacher || student) + (1 - weight) * cross-entropy, summed over the completion tokens and divided
    by `num_items_in_batch` (the completion tokens of the whole accumulation window, as transformers expects; the
    micro-batch's own count when None), so neither the gradient nor the logged loss grows with grad_accum."""
    labels = inputs["labels"][:, 1:]
    mask = labels != -100
    forward = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "position_ids")}
    logits = student(**forward, use_cache=False).logits[:, :-1][mask].float()
    with torch.no_grad():
        teacher_logits = teacher(**forward, use_cache=False).logits[:, :-1][mask].float()
    loss = forward_kl(logits, teacher_logits, kd.temperature, reduction="sum")
    if kd.weight < 1:
        ce = torch.nn.functional.cross_entropy(logits, labels[mask], reduction="sum")
        loss = kd.weight * loss + (1 - kd.weight) * ce
    count = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1)
    return loss / (count.to(loss.device) if isinstance(count, torch.Tensor) else count)


def forward_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, reduction: str = "mean"
) -> torch.Tensor:
    """KL(p_teacher || p_student) over tokens (mean or sum), scaled by T^2 as in Hinton et al."""
    if student_logits.numel() == 0:
        return student_logits.sum()
    student = torch.log_softmax(student_logits / temperature, dim=-1)
    teacher = torch.log_softmax(teacher_logits / temperature, dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return (kl.sum() if reduction == "sum" else kl.mean()) * temperature**2


def check_finite(loss: torch.Tensor, step: int, output_dir: str) -> None:
    if not math.isfinite(float(loss.detach())):
        last = last_checkpoint(Path(output_dir))
        kept = f"last good checkpoint: {last}" if last else "no checkpoint was saved yet"
        raise NonFiniteLossError(
            f"training loss became {float(loss.detach())} at step {step}; stopped ({kept}); "
            "lower train.learning_rate and re-run (add --resume to continue from the checkpoint)"
        )


def last_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint-N folder in a trainer output directory (the trainer writes its
    trainer_state.json last, so a checkpoint without one was cut off while saving)."""
    found = (
        [
            p
            for p in directory.glob("checkpoint-*")
            if p.name.split("-")[-1].isdigit() and _complete(p / "trainer_state.json")
        ]
        if directory.is_dir()
        else []
    )
    return max(found, key=lambda p: int(p.name.split("-")[-1]), default=None)


def prepare_trainer_dir(directory: Path, resume: bool, made_by: dict[str, Any] | None = None) -> Path | None:
    """The checkpoint to resume from (with --resume), else a clean trainer directory. `made_by` (the run's seed) is
    recorded beside the directory; checkpoints recorded as made under another seed are not resumed (a replicate's run
    is never continued under another replicate's label): training starts over."""
    record = directory.parent / TRAINING_RECORD
    made = json.loads(json.dumps(made_by)) if made_by is not None else None
    last = last_checkpoint(directory)
    if resume and last is not None and made is not None and record.is_file() and _read(record) != made:
        log.warning("--resume: the checkpoints in %s were trained under another seed; training from the start",
                    directory)
        resume = False
    if resume:
        if last is None:
            log.warning("--resume: no checkpoint in %s; training from the start", directory)
        else:
            log.info("resuming from %s", last)
    elif directory.exists():
        shutil.rmtree(directory)
    if made is not None:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(made, indent=2))
    return last if resume else None


def made_by(job: Any) -> dict[str, Any]:
    """What a recovery's checkpoints are recorded as made by: the run's seed (a study's replicate r runs under the
    run seed + r). The recipe is not part of it: --resume with more steps extends a run, as the trainer allows."""
    return {"seed": job.settings.seed}


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _complete(state: Path) -> bool:
    try:
        return isinstance(json.loads(state.read_text()), dict)
    except (OSError, ValueError):
        return False


def loss_before(log_history: list[dict[str, Any]]) -> float | None:
    """The held-out loss evaluated at step 0, before training."""
    return loss_at(log_history, 0)


def loss_at(log_history: list[dict[str, Any]], step: int) -> float | None:
    """The held-out loss the trainer evaluated at `step` (the last such entry), None where it did not."""
    return next((e["eval_loss"] for e in reversed(log_history) if "eval_loss" in e and e.get("step") == step), None)


def loss_after(trainer: Any) -> float:
    """The held-out loss of the trained model: the trainer's own evaluation at its last step where it made one
    (transformers evaluates at max_steps; the same weights and held-out set: evaluating again gives the same number),
    else one evaluation (a run a token budget stopped)."""
    logged = loss_at(trainer.state.log_history, trainer.state.global_step)
    return logged if logged is not None else trainer.evaluate()["eval_loss"]


def loss_curve(log_history: list[dict[str, Any]], before: float | None) -> dict[str, list[list[float]]]:
    """[[step, loss], ...] for training and held-out losses (held-out includes step 0, before training)."""
    train = [[e["step"], e["loss"]] for e in log_history if "loss" in e]
    held = {0: before} if before is not None else {}
    held.update({e["step"]: e["eval_loss"] for e in log_history if "eval_loss" in e and e["step"] > 0})
    return {"train": train, "held_out": [[step, loss] for step, loss in sorted(held.items())]}


def plot_loss_curve(curve: dict[str, list[list[float]]], path: Path, title: str) -> None:
    """Save the loss curve as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curve.items():
        if points:
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o" if name == "held_out" else None,
                label=name.replace("_", "-"),
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("hidden-state MSE" if set(curve) == {"local_mse"} else "loss (completion tokens)")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:  # nothing trained (merge alone): an empty chart, no legend
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
