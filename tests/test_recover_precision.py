"""Training every weight at the study's precision: float32 master weights unless train.pure_bf16 opts out (a bf16
AdamW step of 1e-5 is below half a bf16 step for most weights), and the memory plan that follows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from layerprune.core.settings import RunSettings
from layerprune.models import resolve_model
from layerprune.recover import memory, methods, train
from layerprune.recover.job import RecoverJob
from layerprune.recover.methods.sft import load_student
from layerprune.recover.schema import RecoverRecipe


def _rows(n: int = 8) -> list[dict]:
    return [{"prompt": f"what is {i} + 1?", "response": f"The answer is {i + 1}.", "tokens": 5} for i in range(n)]


def _recipe(**train_fields) -> RecoverRecipe:
    return RecoverRecipe.model_validate({
        "method": "full", "generate": {"max_new_tokens": 16},
        "train": {"max_steps": 5, "batch_size": 4, "grad_accum": 1, "warmup_steps": 0, "learning_rate": 1e-5,
                  "gradient_checkpointing": False, "max_length": 64, "logging_steps": 1, **train_fields}})


def fraction_changed(model_dir: Path, tmp_path: Path, recipe: RecoverRecipe) -> tuple[float, torch.dtype]:
    """Share of the decoder blocks' weight elements that 5 AdamW steps at lr 1e-5 changed, loaded as recover loads
    the student with --dtype bfloat16."""
    settings = RunSettings(device="cpu", dtype="bfloat16")
    loaded = load_student(recipe, resolve_model(str(model_dir), settings), settings)
    args = train.sft_config(recipe, tmp_path / "trainer", torch.device("cpu"), "adamw_torch", 0, has_eval=False)
    dataset = train.to_dataset(_rows(), recipe.generate, loaded.tokenizer, 64)
    trainer = train.make_trainer(recipe, loaded.model, loaded.tokenizer, args, dataset, None)
    blocks = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".layers." in n}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    changed = sum(int((params[n].detach() != before).sum()) for n, before in blocks.items())
    return changed / sum(p.numel() for p in blocks.values()), next(iter(params.values())).dtype


def test_full_sft_in_bf16_at_lr_1e5_changes_almost_every_weight(tiny_llama, tmp_path):
    fraction, dtype = fraction_changed(tiny_llama, tmp_path, _recipe())
    assert dtype == torch.float32  # the master copy; the saved model is cast back to the run's dtype
    assert fraction > 0.9, fraction


def test_pure_bf16_is_an_opt_in_that_loses_most_updates_and_is_named(tiny_llama, tmp_path):
    recipe = _recipe(pure_bf16=True)
    fraction, dtype = fraction_changed(tiny_llama, tmp_path, recipe)
    assert dtype == torch.bfloat16 and fraction < 0.5, fraction  # what every full arm did before
    assert "pure_bf16" in train.pure_bf16_note(recipe, RunSettings(device="cpu", dtype="bfloat16"))
    assert train.pure_bf16_note(_recipe(), RunSettings(device="cpu", dtype="bfloat16")) is None
    assert not train.master_fp32(RecoverRecipe(method="lora"), RunSettings(device="cpu", dtype="bfloat16"))
    kd_full = RecoverRecipe.model_validate({"method": "kd", "kd": {"adapter": "full"}})
    assert train.master_fp32(kd_full, RunSettings(device="cpu", dtype="bfloat16"))


LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


def test_full_sft_of_an_8b_model_minus_8_blocks_plans_float32_master_weights_inside_80_gb(tmp_path):
    config = LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": 24})
    recipe = _recipe(learning_rate=1e-5, batch_size=4, grad_accum=2, gradient_checkpointing=True)
    job = RecoverJob(output=tmp_path / "out", settings=RunSettings(dtype="auto"), memory_budget=80.0)
    optimizer, plan = methods.plan_for(recipe, config, job, cuda=True, seq_len=1024)
    assert plan.weight_bytes == 4 and plan.gradients == pytest.approx(plan.weights)  # float32 weights and grads
    assert optimizer == "adamw_8bit" and plan.fits, memory.format_plan(plan, "8b-8")  # 8-bit states where they fit
    assert any("master" in note for note in plan.notes)
    pure = _recipe(pure_bf16=True, batch_size=4, gradient_checkpointing=True)
    _, bf16 = methods.plan_for(pure, config, job, cuda=True, seq_len=1024)
    assert bf16.weight_bytes == 2 and any("pure bf16" in note for note in bf16.notes)

