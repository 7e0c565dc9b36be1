"""models.walker.ablation_measures: the one ablation of a batch that prune's scores and analyze both use."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.models import find_decoder_stack, skipped_blocks
from layerprune.models.walker import BASE, ablation_measures, capture_block_inputs
from layerprune.prune.calib import arithmetic_calib, tokenize_calibration


def last_logits(stack, hidden, batch):  # noqa: ANN001, ANN201
    return stack.logits(hidden[:, -1])


@pytest.mark.parametrize("group", [1, 0])
def test_each_candidate_matches_a_forward_with_it_skipped(tiny_llama, group):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    batch = tokenize_calibration(arithmetic_calib(4, 0, None), AutoTokenizer.from_pretrained(tiny_llama), 64, 4)[0]
    stack = find_decoder_stack(model)
    kept, candidates = [0, 1, 3, 4, 5], [1, 4]  # block 2 already removed
    with torch.inference_mode():
        inputs = capture_block_inputs(stack, batch)
        measures = ablation_measures(stack, inputs, kept, candidates, group, last_logits)
        nll = ablation_measures(stack, inputs, kept, candidates, group)
        for key, skip in {BASE: [2], 1: [1, 2], 4: [2, 4]}.items():
            with skipped_blocks(model, skip):
                logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            torch.testing.assert_close(measures[key], logits[:, -1], rtol=1e-4, atol=1e-4)
            mask = batch.loss_mask[:, 1:].bool()
            total = F.cross_entropy(logits[:, :-1][mask], batch.input_ids[:, 1:][mask], reduction="sum")
            assert nll[key] == (pytest.approx(float(total), rel=1e-5), int(mask.sum()))
    assert sorted(measures) == [BASE, 1, 4]
