"""recover's planning: conflicts before loading, the memory plan from the data, equal sampling on both backends."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from helpers import assert_one_line_error, make_pruned_student, run_cli
from layerprune.core.settings import RunSettings
from layerprune.models import vllm_engine
from layerprune.models.vllm_engine import EngineSettings, llm_kwargs
from layerprune.recover import memory, methods, runner, selfgen, train
from layerprune.recover.job import RecoverJob
from layerprune.recover.schema import GenerationSection, PromptSource, RecoverRecipe
from layerprune.recover.student_teacher import plan_recover

SMALL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def pruned(tiny_models, tmp_path_factory) -> Path:
    return make_pruned_student(tiny_models("llama", 6), tmp_path_factory.mktemp("pruned") / "p2")


# -- conflicts at planning time ------------------------------------------------------------------------------------

def test_a_pruned_model_ignores_the_recipes_drop_blocks_and_its_source_teaches(pruned, tiny_llama):
    recipe = RecoverRecipe(model=str(pruned), drop_blocks=[3, 4, 5])
    planned, student, teacher, notes = plan_recover(recipe, RunSettings())
    assert planned.drop_blocks is None and teacher == str(tiny_llama) and student.location == str(pruned)
    assert "already pruned" in notes[0] and "drop_blocks [3, 4, 5] is ignored" in notes[0]


def test_dry_run_reports_the_conflict_and_loads_nothing(pruned, tiny_llama, capsys, monkeypatch):
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("dry-run loaded a model"))
    code, out, err = run_cli(capsys, ["recover", "--model", str(pruned), "--drop-blocks", "3,4,5", "--dry-run",
                                      "--prompts", str(pruned.parent / "prompts.jsonl")])
    assert code == 0, err
    assert f"teacher: {tiny_llama}" in out and "note: " in out and "is ignored" in out


@pytest.mark.parametrize("case", ["too_many_blocks", "own_teacher", "kd_vocab"])
def test_conflicts_are_refused_before_anything_loads(case, pruned, tiny_llama, tiny_models, capsys, monkeypatch,
                                                     tmp_path):
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    prompts = str(pruned.parent / "prompts.jsonl")
    other_vocab = tmp_path / "other"
    if case == "kd_vocab":
        config = LlamaConfig(**{**SMALL, "vocab_size": 500, "num_hidden_layers": 2})
        AutoModelForCausalLM.from_config(config).save_pretrained(other_vocab)
        AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(other_vocab)
    args, expect = {
        "too_many_blocks": (["--model", str(tiny_llama), "--drop-blocks", "4,9"], "does not fit"),
        "own_teacher": (["--model", str(pruned), "--teacher", str(pruned)], "is the model being recovered"),
        "kd_vocab": (["--model", str(pruned), "--teacher", str(other_vocab), "--method", "kd"], "one vocabulary"),
    }[case]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, ["recover", *args, "--prompts", prompts, "-o", str(out), "--device", "cpu"])
    assert_one_line_error(code, err, expect)
    assert not out.exists() and not (tmp_path / "out.work").exists()


# -- memory plan -----------------------------------------------------------------------------------------------------

def test_plan_uses_the_longest_tokenized_example_the_trainer_sees(pruned):
    rows = [{"prompt": f"what is {i} + 1?", "response": "The answer is " + "one " * i, "tokens": i} for i in range(6)]
    tokenizer = AutoTokenizer.from_pretrained(pruned)
    recipe = RecoverRecipe.model_validate({"train": {"max_length": 512}, "generate": {"system_prompt": None}})
    args = train.sft_config(recipe, Path("/tmp/unused"), torch.device("cpu"), "adamw_torch", 0, has_eval=False)
    trainer = train.make_trainer(recipe, AutoModelForCausalLM.from_pretrained(pruned), tokenizer, args,
                                 train.to_dataset(rows, recipe.generate, tokenizer, 512), None)
    seen = max(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert train.longest_example(tokenizer, rows, recipe.generate) == seen
    job = RecoverJob(output=Path("/tmp/unused"))
    _, plan = methods.plan_for(recipe, AutoModelForCausalLM.from_pretrained(pruned).config, job, cuda=True,
                              seq_len=seen)
    assert plan.seq_len == seen < recipe.train.max_length


def test_kd_counts_the_real_teacher_and_its_logits():
    student = memory.model_shape(LlamaConfig(**SMALL))
    teacher = memory.model_shape(LlamaConfig(**{**SMALL, "num_hidden_layers": 12}))
    kwargs = dict(seq_len=256, batch_size=2, weight_bytes=2, lora_r=8)
    plan = memory.plan_memory(student, "kd", teacher=teacher, **kwargs)
    logits = 256 * 2 * teacher.vocab * 4 * memory.TEACHER_LOGIT_COPIES  # its float32 log-softmax and exp
    assert plan.teacher * memory.GB == pytest.approx(teacher.params * 2 + logits)
    assert teacher.params > student.params


def test_qlora_counts_peft_float32_upcast_of_the_non_quantized_weights():
    shape = memory.model_shape(LlamaConfig(**SMALL))
    plan = memory.plan_memory(shape, "qlora", seq_len=128, batch_size=1, weight_bytes=2, lora_r=8)
    upcast = (shape.params - shape.linear_params) * 4
    assert plan.weights * memory.GB == pytest.approx(shape.linear_params * 0.5 * 1.03 + upcast)


def test_switch_reasons_name_what_is_trained_and_8bit_is_never_chosen_when_sharded(monkeypatch):
    shape = memory.model_shape(LlamaConfig(**SMALL))
    kwargs = dict(seq_len=256, batch_size=1, weight_bytes=2, gradient_checkpointing=True, budget_gb=0.01)
    _, kd_lora = memory.choose_optimizer(shape, "kd", "auto", cuda=True, lora_r=8, **kwargs)
    assert kd_lora.optimizer == "adamw_torch" and not any("full fine-tuning" in n for n in kd_lora.notes)
    optimizer, full = memory.choose_optimizer(shape, "full", "auto", cuda=True, **kwargs)
    assert optimizer == "paged_adamw_8bit" and any("full fine-tuning with AdamW needs" in n for n in full.notes)
    assert any("pure bf16" in n for n in full.notes)
    optimizer, sharded = memory.choose_optimizer(shape, "full", "auto", cuda=True, sharded=True, **kwargs)
    assert optimizer == "adamw_torch" and any("not used under FSDP or ZeRO" in n for n in sharded.notes)
    with pytest.raises(Exception, match="does not work under FSDP"):
        memory.choose_optimizer(shape, "full", "adamw_8bit", cuda=True, sharded=True, **kwargs)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert methods.sharded_training()


def test_study_full_sft_arms_use_a_full_fine_tuning_learning_rate():
    from layerprune.core.recipe_loading import shipped_recipes
    from layerprune.pipeline.recipe import RunRecipe

    arms = sorted(name for _, name in shipped_recipes("run") if name.endswith("-gsm8k-full"))
    assert len(arms) == 9
    for name in arms:
        recover = RunRecipe.load(name).recover.resolve("<pruned>", None)
        assert recover.method == "full" and recover.train.learning_rate <= 5e-5, name


# -- generation ------------------------------------------------------------------------------------------------------

def test_resumed_sampled_generation_equals_an_uninterrupted_one(tiny_llama, pruned, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    prompts = selfgen.load_prompts(PromptSource(source=str(pruned.parent / "prompts.jsonl")), None)
    settings = GenerationSection(max_new_tokens=5, batch_size=4, temperature=1.0, top_p=0.95)
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    selfgen.generate_responses(model, tokenizer, prompts, settings, whole, seed=3)
    torch.manual_seed(12345)  # a different global RNG state must not matter
    selfgen.generate_responses(model, tokenizer, prompts[:5], settings, parts, seed=3)  # "interrupted"
    selfgen.generate_responses(model, tokenizer, prompts, settings, parts, seed=3)
    by_id = lambda path: {r["id"]: r["response"] for r in selfgen.read_responses(path)}  # noqa: E731
    assert by_id(parts) == by_id(whole) and len(by_id(whole)) == 12
    other = tmp_path / "other-seed.jsonl"
    selfgen.generate_responses(model, tokenizer, prompts, settings, other, seed=4)
    assert by_id(other) != by_id(whole)


def test_shards_of_each_rank_merge_into_one_file(tmp_path):
    path = tmp_path / "responses.jsonl"
    rows = [{"id": str(i), "prompt": "p", "response": str(i)} for i in range(6)]
    path.write_text(json.dumps(rows[0]) + "\n")
    for rank in (0, 1):
        selfgen.shard_path(path, rank).write_text("".join(json.dumps(r) + "\n" for r in rows[rank::2]))
    assert selfgen.done_ids(path) == {r["id"] for r in rows}
    selfgen.merge_shards(path)
    assert sorted(r["id"] for r in selfgen.read_responses(path)) == [r["id"] for r in rows]
    assert not selfgen.shard_files(path)


def test_hf_and_vllm_sample_alike_from_the_models_generation_config():
    settings = GenerationSection(temperature=0.7, top_p=0.8, max_new_tokens=32, batch_size=8)
    config = GenerationConfig(top_k=20, repetition_penalty=1.05)
    sampling = selfgen.sampling_settings(config, settings)
    assert sampling == {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    args = selfgen.vllm_sampling_args(sampling, settings, seed=11)
    assert args == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.0,
                    "max_tokens": 32, "seed": 11}
    greedy = selfgen.sampling_settings(config, GenerationSection(temperature=0))
    assert greedy == {"do_sample": False} and selfgen.vllm_sampling_args(greedy, settings, 1)["temperature"] == 0.0


def test_vllm_gets_token_ids_without_a_second_bos_and_the_run_settings(tiny_llama, pruned, tmp_path, monkeypatch):
    calls: dict = {"params": []}

    class LLM:
        def __init__(self, **kwargs):
            calls["engine"] = kwargs

        def generate(self, prompts, params):
            calls["prompts"] = prompts
            calls["params"] += params
            out = types.SimpleNamespace(text=" 19 ", token_ids=[5, 6], finish_reason="stop")
            return [types.SimpleNamespace(outputs=[out]) for _ in prompts]

    shutdown = []
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = LLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(selfgen, "shutdown_llm", shutdown.append)
    monkeypatch.setattr(vllm_engine, "on_cpu", lambda: True)
    monkeypatch.delenv(vllm_engine.CPU_KV_ENV, raising=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = selfgen.load_prompts(PromptSource(source=str(pruned.parent / "prompts.jsonl"), samples=3), None)
    settings = GenerationSection(backend="vllm", batch_size=2, max_new_tokens=7, system_prompt=None)
    stats = selfgen.generate_responses(str(tiny_llama), tokenizer, prompts, settings, tmp_path / "r.jsonl", seed=5,
                                       engine=EngineSettings(dtype="bfloat16"))
    assert stats["generated"] == 3 and len(shutdown) == 1
    hf_ids = [tokenizer(selfgen.render_prompt(tokenizer, p.text, None), add_special_tokens=False)["input_ids"]
              for p in prompts]
    assert [p["prompt_token_ids"] for p in calls["prompts"]] == hf_ids
    assert all(ids.count(tokenizer.bos_token_id) <= 1 for ids in hf_ids)
    engine = calls["engine"]
    assert (engine["dtype"], engine["seed"], engine["max_num_seqs"]) == ("bfloat16", 5, 2)
    assert engine["enforce_eager"] and "gpu_memory_utilization" not in engine  # a CPU: KV cache in GiB instead
    assert os.environ[vllm_engine.CPU_KV_ENV] == "1"
    on_gpu = llm_kwargs("m", selfgen.vllm_engine(10, settings, 5, EngineSettings()), cpu=False)
    assert on_gpu["gpu_memory_utilization"] == settings.vllm_gpu_memory == 0.5 and not on_gpu["enforce_eager"]
    assert engine["max_model_len"] == max(map(len, hf_ids)) + 7
    seeds = [p["seed"] for p in calls["params"]]
    assert seeds == [selfgen.prompt_seed(5, [p.id]) for p in prompts] and len(set(seeds)) == 3
