"""Teacher-forced greedy exact match: the same verdict per item as generating the answer, in one pass."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.models import find_decoder_stack
from layerprune.models.generate import generate_greedy
from layerprune.models.walker import CalibBatch, greedy_match
from layerprune.prune.calib import CalibItem, CalibSet
from layerprune.prune.scores import ScoreContext, run_importance_score
from layerprune.prune.scores.ablation import generated_correct, generated_correct_per_candidate, teacher_forced_correct

MAX_NEW = 5
STOP = "5"  # a digit as the stop string, so the tiny model emits it mid-answer
WORDS = ["the", "fox", "12", "+", "=", "(", "[", "Question:", "dog", "7", "48", "clips", "May"]


def digits_only_model(path):  # noqa: ANN001, ANN201
    """The tiny model with its head biased to emit only single digits that no token merges."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    merged = "".join(t for t in texts if len(t) > 1 and t.isdigit())
    allowed = [i for i, t in enumerate(texts) if len(t) == 1 and t.isdigit() and t not in merged]
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight * 8)
        head.bias.fill_(-1e4)
        head.bias[allowed] = 0.0
    model.lm_head = head
    return model, tokenizer


@pytest.fixture(scope="module")
def digits_ctx(tiny_models):
    model, tokenizer = digits_only_model(tiny_models("llama", 6))
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(40)]
    items = []
    for prompt, text in zip(prompts, generate_greedy(model, tokenizer, prompts, MAX_NEW), strict=False):
        answer = text.split(STOP)[0]
        if answer:  # the full model's own greedy answer (digits up to the stop digit): right for the full model
            items.append(CalibItem(prompt, answer, answer, STOP))
    assert len(items) >= 20 and sum(len(i.answer) < MAX_NEW for i in items) >= 8
    ctx = ScoreContext(model=model, tokenizer=tokenizer, stack=find_decoder_stack(model), batches=[],
                       calib=CalibSet(items, "own answers"), drop=1, protected=[0], metric="accuracy",
                       batch_size=16, max_new_tokens=MAX_NEW)
    return ctx


@pytest.fixture(scope="module")
def generated(digits_ctx):
    """Per skip set, per item: is the generated greedy answer right (the reference)."""
    skips = [(), *((b,) for b in range(6)), (2,), (2, 4)]
    return {skip: generated_correct(digits_ctx, digits_ctx.calib.items, list(skip)) for skip in dict.fromkeys(skips)}


@pytest.mark.parametrize("stacked", [1, 0])
def test_teacher_forced_verdicts_equal_generation_per_item(digits_ctx, generated, stacked):
    digits_ctx.stack_candidates = stacked
    forced = teacher_forced_correct(digits_ctx, digits_ctx.calib.items, list(range(6)), list(range(6)))
    assert all(forced[-1]) and forced[-1] == generated[()]
    for block in range(6):
        assert forced[block] == generated[(block,)], block
    assert any(not all(v) and any(v) for v in forced.values())  # some candidates get some items right, some wrong


def test_teacher_forced_on_a_pruned_model_equals_generation(digits_ctx, generated):
    forced = teacher_forced_correct(digits_ctx, digits_ctx.calib.items, [0, 1, 3, 4, 5], [1, 4])
    assert forced[-1] == generated[(2,)]
    assert forced[4] == generated[(2, 4)]


def test_accuracy_ablation_uses_no_generation_for_short_answers(digits_ctx, generated, monkeypatch):
    import layerprune.prune.scores.ablation as ablation

    monkeypatch.setattr(ablation, "generate_greedy", None)  # any generation would fail
    result = run_importance_score("ablation", digits_ctx)
    assert result.details["base"] == 0.0
    assert result.scores == pytest.approx([1 - sum(generated[(b,)]) / len(generated[(b,)]) for b in range(6)])


def test_free_form_candidates_decoded_together_equal_one_generation_each(digits_ctx, generated):
    skips = {-1: [], **{b: [b] for b in range(6)}, 6: [2, 4]}
    together = generated_correct_per_candidate(digits_ctx, digits_ctx.calib.items, skips)
    assert together == {c: generated[tuple(skip)] for c, skip in skips.items()}
    assert len({tuple(v) for v in together.values()}) > 2  # the candidates' verdicts differ


class HeadIsIdentity:
    """A stack whose logits are the hidden states themselves."""

    def logits(self, hidden):  # noqa: ANN001, ANN201
        return hidden


def test_greedy_match_by_hand():
    # vocab of 4; rows: prompt token then two answer tokens (positions 1, 2); position 3 = after the answer
    ids = torch.tensor([[0, 1, 2, 0], [0, 1, 2, 0], [0, 1, 2, 0], [0, 3, 0, 0]])
    loss = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 0, 0]])
    batch = CalibBatch(ids, torch.ones_like(ids), loss)
    onehot = torch.nn.functional.one_hot
    hidden = torch.stack([
        onehot(torch.tensor([1, 2, 3, 0]), 4),  # predicts 1, 2, then token 3 (a stop)
        onehot(torch.tensor([1, 2, 0, 0]), 4),  # right answer, no stop after it
        onehot(torch.tensor([1, 0, 3, 0]), 4),  # second answer token wrong
        onehot(torch.tensor([3, 3, 0, 0]), 4),  # one-token answer 3, then 3 (a stop)
    ]).float()
    stops = torch.tensor([False, False, False, True])
    needs = torch.tensor([True, True, True, True])
    assert greedy_match(HeadIsIdentity(), hidden, batch, stops, needs).tolist() == [True, False, False, True]
    needs = torch.tensor([True, False, True, True])  # the answer fills the decode budget: no stop needed
    assert greedy_match(HeadIsIdentity(), hidden, batch, stops, needs).tolist() == [True, True, False, True]
