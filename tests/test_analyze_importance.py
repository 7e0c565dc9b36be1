"""`analyze importance` values on a tiny model against a naive loop (one item, one skipped block at a time)."""

from __future__ import annotations

import math

import pytest
import torch

from layerprune.analyze.importance import measure_block_importance
from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.analyze.tasks import Task, TaskItem, task_items
from layerprune.analyze.walk import ablate_generation
from layerprune.models import find_decoder_stack, load_model, skipped_blocks


@torch.no_grad()
def naive_item(model, tokenizer, item: TaskItem) -> tuple[float, int, bool]:
    """Summed answer-token NLL, answer tokens and all-argmax of one item, from one full forward."""
    prompt = tokenizer(item.prompt)["input_ids"]
    target = tokenizer(item.target, add_special_tokens=False)["input_ids"]
    logits = model(input_ids=torch.tensor([prompt + target])).logits[0, len(prompt) - 1 : -1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum")
    return float(nll), len(target), logits.argmax(-1).tolist() == target


def naive_variants(model, tokenizer, items):
    """Per variant (full, then each skipped block): per-item (nll, tokens, correct)."""
    variants = [[naive_item(model, tokenizer, item) for item in items]]
    for block in range(len(find_decoder_stack(model))):
        with skipped_blocks(model, [block]):
            variants.append([naive_item(model, tokenizer, item) for item in items])
    return variants


def probability(rows) -> float:
    return math.exp(-sum(r[0] for r in rows) / sum(r[1] for r in rows))


def accuracy(rows) -> float:
    return sum(r[2] for r in rows) / len(rows)


@pytest.mark.parametrize("metric", ["nll", "accuracy"])
def test_teacher_forced_importance_equals_a_naive_loop(tiny_models, metric):
    loaded = load_model(str(tiny_models("llama", 4)))
    items = task_items("arithmetic", 4, seed=0, shots=1, data_dir=None)
    config = ImportanceAnalysis(metric=metric, batch_size=2, min_base_score=0.0, resamples=200)
    result = measure_block_importance(loaded, "arithmetic", items, config)
    full, *ablated = naive_variants(loaded.model, loaded.tokenizer, items)
    score = probability if metric == "nll" else accuracy
    assert result["base_score"] == pytest.approx(score(full), rel=1e-4)
    assert result["scores"] == pytest.approx([score(rows) for rows in ablated], rel=1e-4)
    if score(full) > 0:
        expected = [(score(full) - score(rows)) / score(full) for rows in ablated]
        assert result["drops"] == pytest.approx(expected, rel=1e-3, abs=1e-6)
    per_item = result["per_item"]
    assert per_item["base_item_nll"] == pytest.approx([r[0] for r in full], rel=1e-4)
    assert per_item["item_tokens"] == [r[1] for r in full]
    assert per_item["ablated_item_correct"] == [[r[2] for r in rows] for rows in ablated]
    flat = [value for values in per_item["ablated_item_nll"] for value in values]
    assert flat == pytest.approx([r[0] for rows in ablated for r in rows], rel=1e-4)


@torch.no_grad()
def naive_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding one token at a time with a full forward each step (no cache, no batch)."""
    ids = tokenizer(prompt)["input_ids"]
    new: list[int] = []
    for _ in range(max_new_tokens):
        token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
        new.append(token)
        if token == tokenizer.eos_token_id:
            break
    return tokenizer.decode(new, skip_special_tokens=True)


def test_generation_importance_equals_a_naive_loop(tiny_models):
    loaded = load_model(str(tiny_models("llama", 4)))
    model, tokenizer = loaded.model, loaded.tokenizer
    items = task_items("factual", 4, seed=0, shots=0, data_dir=None)
    full = [naive_greedy(model, tokenizer, item.prompt, 4) for item in items]
    # graded "right" when the generation starts like the full model's did for the first two items: every
    # skipped block that changes those generations loses them
    items = [TaskItem(item.prompt, item.target, text[:3] if i < 2 else "\u2603") for i, (item, text)
             in enumerate(zip(items, full, strict=False))]
    task = Task(lambda *_: [], lambda text, item: text.startswith(item.answer), 4, "test", ("\u2603",))
    result = ablate_generation(model, tokenizer, items, task, batch_size=2)
    assert result.base_generations == full and result.base_item_correct == [True, True, False, False]
    for block, (texts, correct) in enumerate(
        zip(result.ablated_generations, result.ablated_item_correct, strict=False)
    ):
        with skipped_blocks(model, [block]):
            expected = [naive_greedy(model, tokenizer, item.prompt, 4) for item in items]
        assert texts == expected
        assert correct == [text.startswith(item.answer) for text, item in zip(expected, items, strict=False)]
    assert result.ablated_accuracy == [sum(c) / 4 for c in result.ablated_item_correct]


def test_per_model_decoding_over_the_analysis_wide_settings():
    from layerprune.analyze.schemas import Decoding

    config = ImportanceAnalysis(
        models=["a", "b"],
        max_new_tokens=64,
        per_model={
            "b": Decoding(instruction="Please reason step by step.", max_new_tokens=4096, temperature=0.6, top_p=0.95)
        },
    )
    assert config.decoding("a") == Decoding(chat_template="auto", max_new_tokens=64, temperature=0.0, top_p=1.0)
    b = config.decoding("b")
    assert (b.chat_template, b.max_new_tokens, b.temperature, b.top_p) == ("auto", 4096, 0.6, 0.95)
    with pytest.raises(ValueError, match="not in models"):
        ImportanceAnalysis(models=["a"], per_model={"c": Decoding()})


def test_prompts_follow_the_chat_template_setting_with_the_instruction_before_the_answer_cue(tiny_llama):
    from layerprune.analyze.importance import generation_plan
    from layerprune.analyze.tasks import ANALYSIS_TASKS
    from layerprune.analyze.walk import GenerationPlan, render_prompt

    loaded = load_model(str(tiny_llama))
    loaded.tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<bot>"
    plan = GenerationPlan(8, chat=True, instruction="Think step by step.")
    assert (
        render_prompt(loaded.tokenizer, "Question: 2+2?\nAnswer:", plan)
        == "<user>Question: 2+2?\nThink step by step.\nAnswer:</user><bot>"
    )
    auto = ImportanceAnalysis(models=[str(tiny_llama)], metric="generate")
    assert generation_plan(
        auto, loaded, ANALYSIS_TASKS.get("gsm8k"), 0
    ).chat  # as evaluate's auto: gsm8k is a chat task
    assert not generation_plan(auto, loaded, ANALYSIS_TASKS.get("arithmetic"), 0).chat
    off = ImportanceAnalysis(models=[str(tiny_llama)], chat_template="off")
    assert not generation_plan(off, loaded, ANALYSIS_TASKS.get("gsm8k"), 0).chat
    assert generation_plan(off, loaded, ANALYSIS_TASKS.get("gsm8k"), 0).max_new_tokens == 192


def test_sampled_generation_is_seeded(tiny_llama):
    from layerprune.analyze.walk import GenerationPlan, generate_texts

    loaded = load_model(str(tiny_llama))
    prompts = ["Q: What is the capital of France?\nA:", "Q: 2 + 2 =\nA:"]
    sampled = GenerationPlan(12, temperature=5.0, seed=3)
    first = generate_texts(loaded.model, loaded.tokenizer, prompts, sampled, batch_size=2)
    assert first == generate_texts(loaded.model, loaded.tokenizer, prompts, sampled, batch_size=2)
    other = generate_texts(loaded.model, loaded.tokenizer, prompts, GenerationPlan(12, temperature=5.0, seed=4), 2)
    assert other != first
