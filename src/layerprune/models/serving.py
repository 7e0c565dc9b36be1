"""The serving check: vLLM loads a model directory and its greedy continuations of the verification prompts equal
transformers' (token by token). Written to serve_check.json in the directory."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models.loading import load_model, resolve_model
from layerprune.models.verification import VERIFY_PROMPTS, VERIFY_TOKENS, agreement, reference
from layerprune.models.vllm_engine import engine_settings, on_cpu, require_vllm, shutdown_llm, start_llm

SERVE_CHECK = "serve_check.json"


def vllm_continuations(directory: str, prompt_ids: list[list[int]], settings: RunSettings,
                       max_new_tokens: int = VERIFY_TOKENS) -> tuple[list[list[int]], dict[str, float]]:
    """vLLM's greedy continuations (token ids) of already-tokenized prompts, and its start and run seconds."""
    from vllm import SamplingParams  # type: ignore[import-not-found]

    engine = dataclasses.replace(engine_settings(settings), max_num_seqs=len(prompt_ids),  # a few prompts: on a CPU
                                 max_model_len=max(map(len, prompt_ids)) + max_new_tokens,  # the core in this process
                                 in_process=on_cpu())
    start = time.perf_counter()
    llm = start_llm(directory, engine)
    started = time.perf_counter()
    try:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                               SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
    finally:
        shutdown_llm(llm)
    seconds = {"engine_start_s": round(started - start, 1), "generate_s": round(time.perf_counter() - started, 2)}
    return [list(o.outputs[0].token_ids) for o in outputs], seconds


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
    found, seconds = vllm_continuations(str(directory), expected.prompt_ids, settings)
    result = {
        "engine": f"vllm {_vllm_version()}",
        "dtype": str(settings.resolved_dtype()).removeprefix("torch."),
        "prompts": list(VERIFY_PROMPTS),
        "max_new_tokens": VERIFY_TOKENS,
        **agreement(expected.continuations, found),
        "transformers": expected.continuations,
        "vllm": found,
        **seconds,
    }
    result["passed"] = result["equal"] == result["of"]
    (directory / SERVE_CHECK).write_text(json.dumps(result, indent=2))
    return result


def _vllm_version() -> str:
    import vllm  # type: ignore[import-not-found]

    return str(getattr(vllm, "__version__", "?"))
