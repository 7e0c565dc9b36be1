"""Every candidate of an ablation sweep decoded in one batch equals decoding it with its blocks really dropped."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.models import skipped_blocks
from layerprune.models.row_skips import row_skipped_blocks

PROMPTS = ["Question: what is 12 + 7? Answer:", "The quick brown", "( [ { } ] ) 0 1 2"]


def greedy(model, tokenizer, prompts: list[str]) -> list[list[int]]:
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[:, enc["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_row_skips_decode_each_candidate_as_if_its_blocks_were_dropped(tiny_models, arch):
    path = tiny_models(arch, 6)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    skips = [[], [1], [2, 3], [5]]
    alone = {}
    for skip in skips:
        with skipped_blocks(model, skip):
            alone[tuple(skip)] = greedy(model, tokenizer, PROMPTS)
    rows = [skip for skip in skips for _ in PROMPTS]
    with row_skipped_blocks(model, rows):
        together = greedy(model, tokenizer, PROMPTS * len(skips))
    for n, skip in enumerate(skips):
        assert together[n * len(PROMPTS):(n + 1) * len(PROMPTS)] == alone[tuple(skip)], skip
    assert alone[(2, 3)] != alone[()]  # the candidates really differ, so the comparison means something
    assert greedy(model, tokenizer, PROMPTS) == alone[()]  # hooks removed on exit


def test_row_skips_refuse_a_batch_of_another_size(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    with row_skipped_blocks(model, [[1], []]), pytest.raises(ValueError, match="batch of 2 rows"):
        model(torch.zeros(3, 4, dtype=torch.long))
