"""models.generate: a left-padded batch gives what unpadded one-by-one greedy decoding gives; stop strings and
the end tokens of `generation_config` end a row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.models.generate import (
    cut_at_stops,
    end_token_ids,
    generate_greedy,
    generate_ids,
    generate_new_tokens,
    left_padded,
)

PROMPTS = ["The quick brown fox", "Question: what is 12 + 7? Answer:", "(", "Natalia sold clips to 48 of her",
           "You are"]
MAX_NEW = 10


@pytest.fixture(scope="module")
def llama(tiny_models):
    path = tiny_models("llama", 4)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.padding_side == "right"
    return model, tokenizer


@torch.no_grad()
def one_by_one(model, tokenizer, prompt: str, end_ids: list[int]) -> list[int]:
    """Greedy decoding of one unpadded prompt, a full forward per token (no cache), up to an end token."""
    ids = tokenizer(prompt)["input_ids"]
    new: list[int] = []
    for _ in range(MAX_NEW):
        token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
        if token in end_ids:
            break
        new.append(token)
    return new


def test_end_token_ids_read_generation_config_then_tokenizer():
    tokenizer = SimpleNamespace(eos_token_id=2)

    def model(eos):
        return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))

    assert end_token_ids(model(7), tokenizer) == [7, 2]
    assert end_token_ids(model([7, 2, 9]), tokenizer) == [7, 2, 9]
    assert end_token_ids(model(None), tokenizer) == [2]
    assert end_token_ids(SimpleNamespace(), SimpleNamespace(eos_token_id=None)) == []


def test_left_padded_batches_equal_unpadded_greedy(llama):
    model, tokenizer = llama
    expected = [one_by_one(model, tokenizer, prompt, end_token_ids(model, tokenizer)) for prompt in PROMPTS]
    lengths = {len(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS}
    assert len(lengths) > 1 and sum(len(ids) == MAX_NEW for ids in expected) >= 2  # padded, and long answers
    assert generate_ids(model, tokenizer, PROMPTS, MAX_NEW) == expected
    texts = generate_greedy(model, tokenizer, PROMPTS, MAX_NEW, batch_size=2)
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    assert tokenizer.padding_side == "right"  # left only while encoding


def printable_stop(tokenizer, rows: list[list[int]]) -> tuple[int, int, str]:
    """A row, a position and the printable text of the two tokens there, seen nowhere earlier in that row."""
    for row, ids in enumerate(rows):
        for at in range(1, len(ids) - 2):
            stop, text = tokenizer.decode(ids[at: at + 2]), tokenizer.decode(ids[: at + 2])
            if stop.strip() and text.isascii() and text.isprintable() and text.find(stop) == len(text) - len(stop):
                return row, at, stop
    raise AssertionError("no printable pair of tokens in the generations")


def test_stop_strings_end_and_cut_each_row(llama):
    model, tokenizer = llama
    full_ids = generate_ids(model, tokenizer, PROMPTS, MAX_NEW)
    full = [tokenizer.decode(ids, skip_special_tokens=True) for ids in full_ids]
    row, at, stop = printable_stop(tokenizer, full_ids)
    texts = generate_greedy(model, tokenizer, PROMPTS, MAX_NEW, [stop], batch_size=len(PROMPTS))
    assert texts == [cut_at_stops(text, [stop]) for text in full] and texts[row] == tokenizer.decode(full_ids[row][:at])
    stopped = generate_ids(model, tokenizer, PROMPTS, MAX_NEW, [stop])
    assert stopped[row] == full_ids[row][: at + 2]  # generation ended at the token that completed the stop string


def test_generation_config_eos_ends_generation(llama):
    model, tokenizer = llama
    full = generate_ids(model, tokenizer, PROMPTS, MAX_NEW)
    row = next(n for n, ids in enumerate(full) if len(ids) == MAX_NEW and ids[3] not in ids[:3])
    custom = full[row][3]  # a token the model emits: made an end token, it ends every row that reaches it
    assert custom not in (tokenizer.eos_token_id, tokenizer.pad_token_id)
    expected = [ids[: ids.index(custom)] if custom in ids else ids for ids in full]
    saved = model.generation_config.eos_token_id
    try:
        for configured in (custom, [custom, saved]):
            model.generation_config.eos_token_id = configured
            assert generate_ids(model, tokenizer, PROMPTS, MAX_NEW) == expected
            raw = generate_new_tokens(model, tokenizer, left_padded(tokenizer, PROMPTS), MAX_NEW)
            assert raw[row, 3] == custom and (raw[row, 4:] == tokenizer.pad_token_id).all()  # stopped, padded
        assert generate_greedy(model, tokenizer, PROMPTS, MAX_NEW) == tokenizer.batch_decode(expected,
                                                                                     skip_special_tokens=True)
    finally:
        model.generation_config.eos_token_id = saved
    assert any(token != tokenizer.pad_token_id for token in full[row][4:])  # without it the row went on


def test_cut_at_stops():
    assert cut_at_stops("18 apples.\nQuestion: next", ("Question:", "</s>")) == "18 apples.\n"
    assert cut_at_stops("no stop here", ()) == "no stop here"


def test_a_long_generation_says_how_far_it_is(llama, monkeypatch, caplog):
    """Thousands of prompts (a variant's sampling) run for many minutes: progress is logged as it goes, not once at
    the end (here every batch, the interval set to 0)."""
    from layerprune.models import generate

    model, tokenizer = llama
    monkeypatch.setattr(generate, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level("INFO", logger="layerprune.models.generate"):
        generate_greedy(model, tokenizer, PROMPTS, 2, batch_size=2)
    said = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert said == ["generated 2 of 5 continuations", "generated 4 of 5 continuations"]
