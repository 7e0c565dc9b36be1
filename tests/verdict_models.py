"""Tiny models for the serving verdict's tests: confident ones (logits large enough that most positions are not
near-ties), one that emits an end token early, and planted errors (a wrong norm) beside rounding-only copies."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from layerprune.models.verification import reference

CONFIDENCE = 20.0  # the final norm's weight, times: logits of std ~5 instead of ~0.2 (margins mostly above 0.25)


def confident(config: Any, seed: int = 0, std: float = 0.15) -> Any:
    """A random model of `config`, every weight N(0, std), its final norm scaled by CONFIDENCE."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
        model.model.norm.weight.mul_(CONFIDENCE)
    return model


def end_early(model: Any, tokenizer: Any, end_id: int, after: int = 2) -> Any:
    """`model` made to emit `end_id` at step `after` of its first verification prompt: the output rows of `end_id`
    and of the token it would have emitted there swap (the head must not be tied to the embeddings)."""
    assert not model.config.tie_word_embeddings
    token = reference(model, tokenizer).continuations[0][after]
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[[token, end_id]] = head[[end_id, token]]
    return model


def wrong_norm(model: Any, block: int = 1) -> Any:
    """A copy of `model` whose block `block` input norm is halved: a real error."""
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.model.layers[block].input_layernorm.weight.mul_(0.5)
    return wrong


def rounded(model: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A copy of `model` with every weight rounded to `dtype` and back: a rounding-only change."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for param in copied.parameters():
            param.copy_(param.to(dtype).float())
    return copied


def save(model: Any, tokenizer: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
