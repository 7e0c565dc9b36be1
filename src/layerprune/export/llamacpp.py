"""Run an exported GGUF with llama.cpp itself (llama-cpp-python) and compare it with transformers on the
verification prompts: tokenization, and the verdict of models/verification.compare (llama.cpp's logits at every
position of prompt + transformers' continuation, its greedy continuations, both sides cut at the model's end
tokens)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.core.errors import LayerpruneError
from layerprune.export.readback import file_encoding
from layerprune.models.verification import Reference, compare, max_abs_error, near_tie_for, reference


def require_llama_cpp() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise LayerpruneError("running a GGUF with llama.cpp needs llama-cpp-python: "
                              "pip install 'layerprune[gguf-run]'")


def llama_cpp_answers(path: Path, expected: Reference) -> tuple[list[torch.Tensor], list[list[int]], Any]:
    """llama.cpp's logits at every position of each of transformers' sequences (prompt + continuation), its greedy
    continuation of each prompt (until its end-of-generation token, kept, or the window), and the Llama."""
    from llama_cpp import Llama  # type: ignore[import-not-found]

    llm = Llama(model_path=str(path), n_ctx=512, logits_all=True, verbose=False, seed=0, n_threads=1)
    logits, continuations = [], []
    for ids, sequence in zip(expected.prompt_ids, expected.sequences, strict=True):
        llm.reset()
        llm.eval(sequence)
        logits.append(torch.tensor(llm.scores[: len(sequence)]).float())
        continuations.append(_greedy(llm, ids, expected.max_new_tokens))
    return logits, continuations, llm


def _greedy(llm: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    """llama.cpp's greedy new tokens after `ids`, up to and with its first end-of-generation token."""
    new: list[int] = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if len(new) >= max_new_tokens:
            break
        new.append(int(token))
        if llm.token_eos() == token:
            break
    return new


def compare_with_transformers(path: Path, model_dir: Path) -> dict[str, Any]:
    """llama.cpp on the GGUF against transformers on the directory (float32), on the verification prompts."""
    require_llama_cpp()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = reference(model, tokenizer)
    logits, continuations, llm = llama_cpp_answers(path, expected)
    same_tokens = [llm.tokenize(tokenizer.decode(ids, skip_special_tokens=True).encode(), add_bos=bool(
        tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id])) == ids
        for ids in expected.prompt_ids]
    verdict = compare(expected, [row.argmax(-1).tolist() for row in logits], continuations,
                      {"max_abs_logit_diff": max_abs_error(expected.logits, logits)}, near_tie_for(file_encoding(path)))
    continuations_found = verdict["continuations"]
    return {"tokenization_equal": f"{sum(same_tokens)}/{len(same_tokens)}", **verdict,
            "transformers": expected.continuations, "llama_cpp": continuations_found["engine"]}
