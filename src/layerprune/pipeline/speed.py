"""Tokens per second of a model on this machine: a forward pass over a fixed batch, and greedy decoding."""

from __future__ import annotations

import time
from typing import Any

import torch

from layerprune.models.generate import generate_new_tokens


def measure_throughput(model: Any, tokenizer: Any, seq_len: int = 256, batch: int = 4, new_tokens: int = 32,
                       repeats: int = 3) -> dict[str, float]:
    """Median-of-`repeats` prefill tokens/s and decode tokens/s (batch 1, KV cache)."""
    ids = torch.randint(
        10, min(tokenizer.vocab_size, 30000), (batch, seq_len), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(model.device)
    prompt = ids[:1, :32]
    with torch.inference_mode():
        model(input_ids=ids[:, :16])  # warm-up
        prefill = _median([_timed(lambda: model(input_ids=ids, use_cache=False)) for _ in range(repeats)])
        decode = _median(
            [
                _timed(
                    lambda: generate_new_tokens(
                        model, tokenizer, {"input_ids": prompt}, new_tokens, min_new_tokens=new_tokens
                    )
                )
                for _ in range(repeats)
            ]
        )
    return {"prefill_tokens_per_s": batch * seq_len / prefill, "decode_tokens_per_s": new_tokens / decode}


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
