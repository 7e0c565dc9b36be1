"""Importance scores: pure functions against hand-computed values; prefix reuse equals the naive loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.models import find_decoder_stack, skipped_blocks
from layerprune.prune.calib import CalibSet, arithmetic_calib, load_calibration, tokenize_calibration
from layerprune.prune.metrics import (
    angular_distance,
    best_contiguous_run,
    block_influence,
    select_lowest,
    taylor_importance,
)
from layerprune.prune.scores import SCORES, ScoreContext, run_importance_score

MASK = torch.ones(1, 2)


def states(*vectors):  # noqa: ANN001, ANN202
    return torch.tensor([vectors], dtype=torch.float32)


def test_block_influence_by_hand():
    h_in = states([1.0, 0.0], [1.0, 1.0])
    h_out = states([0.0, 1.0], [2.0, 2.0])  # orthogonal (cos 0), parallel (cos 1)
    assert block_influence(h_in, h_out, MASK) == (pytest.approx(1.0), 2)
    assert block_influence(h_in, h_out, torch.tensor([[0, 1]])) == (pytest.approx(0.0, abs=1e-6), 1)


def test_angular_distance_by_hand():
    a = states([1.0, 0.0], [1.0, 0.0])
    b = states([0.0, 1.0], [-1.0, 0.0])  # 90 and 180 degrees -> 0.5 and 1.0
    total, count = angular_distance(a, b, MASK)
    assert count == 2 and total == pytest.approx(1.5)
    c = states([1.0, 1.0], [1.0, 0.0])  # 45 degrees -> 0.25
    assert angular_distance(a[:, :1], c[:, :1], torch.ones(1, 1))[0] == pytest.approx(0.25)


def test_taylor_importance_by_hand():
    grad, weight = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0])
    assert taylor_importance([(grad, weight), (torch.tensor([0.5]), torch.tensor([-2.0]))]) == pytest.approx(12.0)


def test_select_lowest_respects_protection_and_skips_unscored():
    scores = [0.1, 0.5, None, 0.2, 0.05, float("nan")]
    assert select_lowest(scores, 2, protected=[4]) == [0, 3]
    assert select_lowest(scores, 2, protected=[0]) == [3, 4]


def test_best_contiguous_run():
    distances = [0.9, 0.2, 0.1, 0.3, None, None]
    assert best_contiguous_run(distances, 2, protected=[0]) == [2, 3]
    assert best_contiguous_run(distances, 2, protected=[2]) == [3, 4]
    assert best_contiguous_run(distances, 2, protected=[2, 3]) == [0, 1]
    assert best_contiguous_run([0.5, None], 2, protected=[0]) == []


def test_registry_suggests_close_names():
    from layerprune.core.errors import LayerpruneError

    with pytest.raises(LayerpruneError, match="did you mean: block-influence"):
        SCORES.get("block-influnce")
    assert set(SCORES.names()) == {"ablation", "angular", "block-influence", "last", "random", "taylor"}


def test_mixed_calibration_takes_an_equal_share():
    calib = load_calibration("arithmetic+arithmetic", 5, 0, None)
    assert len(calib.items) == 5 and " + " in calib.description


@pytest.fixture(params=["llama", "gemma3_text", "qwen2", "phi3"])
def tiny_ctx(request, tiny_models):
    path = tiny_models(request.param, 6)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    calib = arithmetic_calib(6, 0, None)
    batches = tokenize_calibration(calib, tokenizer, 64, 4)
    return ScoreContext(model=model, tokenizer=tokenizer, stack=find_decoder_stack(model), batches=batches,
                        calib=calib, drop=2, protected=[0])


def naive_loss(model, batches, skip):  # noqa: ANN001, ANN202
    total, count = 0.0, 0
    with torch.no_grad(), skipped_blocks(model, skip):
        for b in batches:
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            mask = b.loss_mask[:, 1:].bool()
            total += float(F.cross_entropy(logits[:, :-1][mask], b.input_ids[:, 1:][mask], reduction="sum"))
            count += int(mask.sum())
    return total / count


@pytest.mark.parametrize("stacked", [0, 1, 4])
def test_prefix_reuse_ablation_equals_naive_full_forward(tiny_ctx, stacked):
    tiny_ctx.stack_candidates = stacked  # all candidates stacked, one at a time, groups of 4 then 2
    result = run_importance_score("ablation", tiny_ctx)
    base = naive_loss(tiny_ctx.model, tiny_ctx.batches, [])
    assert result.details["base"] == pytest.approx(base, rel=1e-5)
    for block, score in enumerate(result.scores):
        assert score == pytest.approx(naive_loss(tiny_ctx.model, tiny_ctx.batches, [block]) - base, abs=1e-5)


def test_iterative_caches_keep_only_the_first_hidden_state(tiny_ctx):
    """keep_hidden=False stores nothing past block 0: no entry pins the storage of the state it came from."""
    from layerprune.models.walker import capture_block_inputs

    with torch.inference_mode():
        inputs = capture_block_inputs(tiny_ctx.stack, tiny_ctx.batches[0], keep_hidden=False)
    first, *rest = inputs.hidden
    assert first.numel() and rest
    assert all(state.untyped_storage().nbytes() == 0 for state in rest)


@pytest.mark.parametrize("stacked", [0, 2])
def test_iterative_ablation_equals_naive_greedy(tiny_ctx, stacked):
    tiny_ctx.iterative, tiny_ctx.stack_candidates = True, stacked
    result = run_importance_score("ablation", tiny_ctx)
    dropped: list[int] = []
    for step in result.steps:
        losses = {c: naive_loss(tiny_ctx.model, tiny_ctx.batches, sorted([*dropped, c])) for c in step["deltas"]}
        for c, delta in step["deltas"].items():
            assert delta + step["base"] == pytest.approx(losses[c], abs=1e-5)
        dropped.append(min(losses, key=lambda c: (losses[c], -c)))
        assert step["dropped"] == dropped[-1]


def test_influence_scores_match_hidden_states(tiny_ctx):
    """Each block's score is its token-weighted mean of 1 - cos over every calibration batch, as computed from
    the model's own hidden_states (hidden_states[l] is block l's input for l < L; the last is after the norm)."""
    assert len(tiny_ctx.batches) >= 2  # batches of unequal padding: a per-batch mean would differ
    result = run_importance_score("block-influence", tiny_ctx)
    depth = len(tiny_ctx.stack)
    totals = [[0.0, 0] for _ in range(depth - 1)]
    with torch.no_grad():
        for batch in tiny_ctx.batches:
            out = tiny_ctx.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 output_hidden_states=True)
            for block, total in enumerate(totals):
                value, count = block_influence(out.hidden_states[block], out.hidden_states[block + 1],
                                               batch.attention_mask)
                total[0] += value
                total[1] += count
    assert result.scores[: depth - 1] == pytest.approx([s / n for s, n in totals], rel=1e-5, abs=1e-6)
    assert all(0.0 <= s <= 2.0 for s in result.scores)


def test_random_is_seeded(tiny_ctx):
    first = run_importance_score("random", tiny_ctx).scores
    assert run_importance_score("random", tiny_ctx).scores == first
    tiny_ctx.seed = 1
    assert run_importance_score("random", tiny_ctx).scores != first


def test_taylor_leaves_no_gradients(tiny_ctx):
    run_importance_score("taylor", tiny_ctx)
    assert all(p.grad is None for p in tiny_ctx.model.parameters())
    assert all(p.requires_grad for p in tiny_ctx.model.parameters())


def test_calibration_masks_only_answers(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    calib = CalibSet(arithmetic_calib(2, 0, None).items, "x")
    batch = tokenize_calibration(calib, tokenizer, 256, 2)[0]
    scored = {tokenizer.decode(batch.input_ids[row][batch.loss_mask[row].bool()]).strip() for row in range(2)}
    assert scored == {item.answer.strip() for item in calib.items}
