"""Run an exported GGUF with llama.cpp itself (llama-cpp-python) and compare it with transformers on the
verification prompts: tokenization, top-1 next token at every prompt position, greedy continuation."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.core.errors import LayerpruneError
from layerprune.models.verification import VERIFY_TOKENS, agreement, reference


def require_llama_cpp() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise LayerpruneError("running a GGUF with llama.cpp needs llama-cpp-python: "
                              "pip install 'layerprune[gguf-run]'")


def llama_cpp_answers(path: Path, prompt_ids: list[list[int]], max_new_tokens: int = VERIFY_TOKENS
                      ) -> tuple[list[list[int]], list[list[int]], Any]:
    """llama.cpp's top-1 token at each prompt position and its greedy continuation, per prompt (given token ids)."""
    import numpy as np
    from llama_cpp import Llama  # type: ignore[import-not-found]

    llm = Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, seed=0, n_threads=1)
    top1, continuations = [], []
    for ids in prompt_ids:
        llm.reset()
        llm.eval(ids)
        top1.append(np.asarray(llm.scores[: len(ids)]).argmax(-1).tolist())
        llm.reset()
        new: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if llm.token_eos() == token or len(new) >= max_new_tokens:
                break
            new.append(int(token))
        continuations.append(new)
    return top1, continuations, llm


def compare_with_transformers(path: Path, model_dir: Path) -> dict[str, Any]:
    """llama.cpp on the GGUF against transformers on the directory (float32), on the verification prompts."""
    require_llama_cpp()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = reference(model, tokenizer)
    top1, continuations, llm = llama_cpp_answers(path, expected.prompt_ids)
    same_tokens = [llm.tokenize(tokenizer.decode(ids, skip_special_tokens=True).encode(), add_bos=bool(
        tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id])) == ids
        for ids in expected.prompt_ids]
    positions = sum(map(len, expected.top1))
    same = sum(a == b for e, g in zip(expected.top1, top1, strict=True) for a, b in zip(e, g, strict=True))
    return {"tokenization_equal": f"{sum(same_tokens)}/{len(same_tokens)}", "top1_agreement": f"{same}/{positions}",
            "continuations": agreement(expected.continuations, continuations),
            "transformers": expected.continuations, "llama_cpp": continuations}
