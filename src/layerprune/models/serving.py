"""The serving check: vLLM loads a model directory and answers the verification prompts as transformers does: its
top-1 token at every position of prompt + transformers' continuation (teacher-forced, with log-probs) and its greedy
continuations, both sides cut at the model's end tokens; the verdict is models/verification.compare's. Written to
serve_check.json in the directory."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models.loading import load_model, resolve_model
from layerprune.models.verification import VERIFY_PROMPTS, VERIFY_TOKENS, Reference, compare, near_tie_for, reference
from layerprune.models.vllm_engine import engine_settings, on_cpu, require_vllm, shutdown_llm, start_llm

SERVE_CHECK = "serve_check.json"


@dataclasses.dataclass
class VllmAnswers:
    """vLLM's answers to the reference: per prompt, its top-1 at every position of prompt + transformers'
    continuation, its log-probs there ({token: log-prob}, the top-1's and the next token's), and its greedy
    continuation (as generated: a stop token kept)."""

    top1: list[list[int]]
    logprobs: list[list[dict[int, float]]]
    continuations: list[list[int]]


def vllm_answers(directory: str, expected: Reference, settings: RunSettings
                 ) -> tuple[VllmAnswers, dict[str, float]]:
    """vLLM's answers to the reference (one engine: teacher-forced sequences, then greedy continuations), and its
    start and run seconds."""
    from vllm import SamplingParams  # type: ignore[import-not-found]

    sequences = expected.sequences
    longest = max(max(map(len, sequences)) + 1, max(map(len, expected.prompt_ids)) + expected.max_new_tokens)
    engine = dataclasses.replace(engine_settings(settings), max_num_seqs=len(sequences), max_model_len=longest,
                                 in_process=on_cpu())  # a few prompts: on a CPU the core in this process
    start = time.perf_counter()
    llm = start_llm(directory, engine)
    started = time.perf_counter()
    try:
        forced = llm.generate([{"prompt_token_ids": ids} for ids in sequences],
                              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, logprobs=1))
        greedy = llm.generate([{"prompt_token_ids": ids} for ids in expected.prompt_ids],
                              SamplingParams(temperature=0.0, max_tokens=expected.max_new_tokens))
    finally:
        shutdown_llm(llm)
    seconds = {"engine_start_s": round(started - start, 1), "generate_s": round(time.perf_counter() - started, 2)}
    rows = [_position_logprobs(o) for o in forced]
    top1 = [[min(row, key=lambda token: (row[token][1], -row[token][0])) for row in per] for per in rows]
    logprobs = [[{token: value for token, (value, _) in row.items()} for row in per] for per in rows]
    return VllmAnswers(top1, logprobs, [list(o.outputs[0].token_ids) for o in greedy]), seconds


def _position_logprobs(output: Any) -> list[dict[int, tuple[float, int]]]:
    """{token: (log-prob, rank)} at every position of a teacher-forced request: position i's from the prompt
    log-probs of token i + 1, the last position's from the one generated token."""
    after = [*output.prompt_logprobs[1:], output.outputs[0].logprobs[0]]
    return [{int(token): (float(lp.logprob), int(lp.rank or 1)) for token, lp in row.items()} for row in after]


def logprob_error(expected: Reference, logprobs: list[list[dict[int, float]]]) -> float:
    """The largest |transformers' log-prob - vLLM's| over the tokens vLLM reported at every position."""
    worst = 0.0
    for logits, per in zip(expected.logits, logprobs, strict=True):
        reference_lp = logits.log_softmax(-1)
        for position, row in enumerate(per):
            tokens = torch.tensor(list(row))
            found = torch.tensor(list(row.values()))
            worst = max(worst, (reference_lp[position, tokens] - found).abs().max().item())
    return round(worst, 5)


def check_serve(directory: Path, settings: RunSettings | None = None) -> dict[str, Any]:
    """Run the serving check on a model directory; the result is also written to DIR/serve_check.json."""
    settings = settings or RunSettings()
    require_vllm("check-serve")
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise LayerpruneError(f"{directory} is not a model directory (no config.json)")
    loaded = load_model(resolve_model(str(directory), settings), settings)
    expected = reference(loaded.model, loaded.tokenizer)
    del loaded
    found, seconds = vllm_answers(str(directory), expected, settings)
    dtype = str(settings.resolved_dtype()).removeprefix("torch.")
    verdict = compare(expected, found.top1, found.continuations,
                      {"max_abs_logprob_diff": logprob_error(expected, found.logprobs)}, near_tie_for(dtype))
    continuations = verdict.pop("continuations")
    result = {
        "engine": f"vllm {_vllm_version()}",
        "dtype": dtype,
        "prompts": list(VERIFY_PROMPTS),
        "max_new_tokens": VERIFY_TOKENS,
        **{key: continuations[key] for key in ("equal", "of", "first_difference", "parted_at_near_tie")},
        **verdict,
        "transformers": expected.continuations,
        "vllm": continuations["engine"],
        "vllm_as_generated": found.continuations,
        **seconds,
    }
    (directory / SERVE_CHECK).write_text(json.dumps(result, indent=2))
    return result


def _vllm_version() -> str:
    import vllm  # type: ignore[import-not-found]

    return str(getattr(vllm, "__version__", "?"))
