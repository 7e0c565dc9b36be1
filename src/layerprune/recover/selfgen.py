"""Stage 1: the teacher answers prompts; responses are appended to a JSONL file as they come (resumable)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.models.vllm_engine import EngineSettings, require_vllm, shutdown_llm, start_llm
from layerprune.recover.schema import GenerationSection, PromptSource
from layerprune.tasks.data import HUB_SOURCE, hub_dataset_rows, iter_jsonl, load_rows, parse_hub_source, read_jsonl
from layerprune.tasks.grading import final_number, grade_number

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One prompt, its stable id (for resuming) and its known answer, if any."""

    id: str
    text: str
    answer: str | None = None


def prompt_id(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def load_prompts(source: PromptSource, data_dir: Path | None) -> list[Prompt]:
    """Prompts of the recipe's source, shuffled with its seed and cut to `samples`; empty is an error."""
    rows = _source_rows(source, data_dir)
    prompts = list({p.id: p for p in (_to_prompt(row, source) for row in rows) if p is not None}.values())
    if not prompts:
        raise LayerpruneError(f"the prompt set '{source.source}' is empty (no non-empty '{_field(source)}' values)")
    random.Random(source.shuffle_seed).shuffle(prompts)
    return prompts[: source.samples] if source.samples else prompts


def _source_rows(source: PromptSource, data_dir: Path | None) -> list[dict[str, Any]]:
    if source.source.startswith(HUB_SOURCE):
        repo, config = parse_hub_source(source.source)
        rows = hub_dataset_rows(repo, config, source.split, "save the split as a .jsonl file and give its path")
    elif source.source.endswith(".jsonl"):
        rows = read_jsonl(Path(source.source).expanduser())
    else:
        return load_rows(source.source, source.split, data_dir)
    if rows and not any(_field(source) in row for row in rows):  # a user's file or dataset: name its columns
        raise LayerpruneError(f"'{source.source}' has no '{_field(source)}' field (prompts.field); its fields: "
                              f"{', '.join(sorted(rows[0]))}")
    return rows


def _field(source: PromptSource) -> str:
    return {"gsm8k": "question", "dolly": "instruction", "alpaca_seed": "instruction"}.get(source.source, source.field)


def _to_prompt(row: dict[str, Any], source: PromptSource) -> Prompt | None:
    text = str(row.get(_field(source)) or "").strip()
    if not text:
        return None
    if source.source == "dolly" and row.get("context"):
        text = f"{text}\n\n{row['context']}"
    if source.source == "alpaca_seed" and row.get("instances") and row["instances"][0].get("input"):
        text = f"{text}\n\n{row['instances'][0]['input']}"
    answer = row.get("answer")
    if source.source == "gsm8k" and answer is not None:
        answer = final_number(str(answer)) or None
    return Prompt(prompt_id(text), text, None if answer is None else str(answer))


def is_correct(response: str, answer: str | None) -> bool:
    """Whether the response's final number (layerprune.tasks.grading) equals the known answer's, as numbers."""
    return answer is not None and grade_number(response, final_number(answer))


def chat_messages(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": prompt}]


def render_prompt(tokenizer: Any, prompt: str, system_prompt: str | None) -> str:
    """The chat-template text the teacher continues; templates without a system role get it inline."""
    if not getattr(tokenizer, "chat_template", None):
        raise LayerpruneError("the teacher's tokenizer has no chat template; self-generation needs one")
    try:
        return tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # e.g. "System role not supported"
        inline = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        return tokenizer.apply_chat_template(chat_messages(inline, None), tokenize=False, add_generation_prompt=True)


def prompt_text(tokenizer: Any, prompt: str, settings: GenerationSection) -> str:
    """What the teacher continues: the chat-template text, or (generate.chat_template false) the prompt itself."""
    return render_prompt(tokenizer, prompt, settings.system_prompt) if settings.chat_template else prompt


def encode_prompt(tokenizer: Any, text: str, settings: GenerationSection) -> list[int]:
    """Token ids of a rendered prompt: a template already holds its special tokens; plain text is encoded as the
    evaluation encodes a context (the tokenizer's default special tokens)."""
    return list(tokenizer(text, add_special_tokens=not settings.chat_template)["input_ids"])


def plain_completion(response: str, settings: GenerationSection) -> str:
    """The plain-format training completion: the answer and the stop that ended it (no end-of-sequence token)."""
    return response + settings.stop


def plain_example(
    tokenizer: Any, prompt: str, response: str, settings: GenerationSection, max_length: int
) -> tuple[list[int], int]:
    """(token ids, index of the first completion token) of plain prompt + answer + stop: the prompt encoded as the
    evaluation encodes it, the completion as the continuation of those tokens; cut to max_length."""
    prompt_ids = encode_prompt(tokenizer, prompt, settings)
    completion_ids = list(tokenizer(plain_completion(response, settings), add_special_tokens=False)["input_ids"])
    return (prompt_ids + completion_ids)[:max_length], len(prompt_ids)


def stop_token_ids(tokenizer: Any, stop: str) -> list[int]:
    """Every token whose text contains `stop`: generating one ends a plain continuation where the evaluation's
    stop string would cut it."""
    return [i for i in range(len(tokenizer)) if stop in tokenizer.decode([i])]


def cut_at_stop(text: str, stop: str) -> tuple[str, bool]:
    """The text before the first `stop` (not stripped: ' 17' keeps its space) and whether a stop was found."""
    head, found, _ = text.partition(stop)
    return head, bool(found)


def done_ids(path: Path) -> set[str]:
    """Ids of prompts already answered in a responses file or in any rank's shard file next to it."""
    return {row["id"] for file in [path, *shard_files(path)] for row in iter_jsonl(file) if "id" in row}


def shard_path(path: Path, rank: int) -> Path:
    """Where one rank of a multi-process run appends its answers before the main process merges them."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def shard_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}"))


def merge_shards(path: Path) -> None:
    """Append the ranks' answers to the responses file (each id once), then delete the shard files."""
    for shard in shard_files(path):
        done = {row["id"] for row in iter_jsonl(path) if "id" in row}
        drop_torn_tail(shard)
        _append(path, (row for row in iter_jsonl(shard) if row.get("id") not in done))
        shard.unlink()


def read_responses(path: Path) -> list[dict[str, Any]]:
    return [row for row in iter_jsonl(path) if "response" in row]


def sampling_settings(generation_config: Any, settings: GenerationSection) -> dict[str, Any]:
    """The sampling both backends use: the recipe's temperature and top-p over the model's generation_config
    (top_k, repetition_penalty, min_p), as Hugging Face's generate would combine them."""
    if settings.temperature == 0:
        return {"do_sample": False}
    found = {name: getattr(generation_config, name, None) for name in ("top_k", "repetition_penalty", "min_p")}
    return {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p,
            **{name: value for name, value in found.items() if value is not None}}


def prompt_seed(seed: int, ids: Iterable[str]) -> int:
    """A seed from the run's seed and prompt ids: the same prompt samples the same way in any run."""
    digest = hashlib.sha256(f"{seed}:{','.join(ids)}".encode()).hexdigest()
    return int(digest[:8], 16)


def generate_responses(model: Any, tokenizer: Any, prompts: list[Prompt], settings: GenerationSection,
                       path: Path, seed: int = 0, engine: EngineSettings | None = None,
                       done: set[str] | None = None) -> dict[str, Any]:
    """Answer every prompt not yet in `path` (or its shard files), appending one JSON line per response.

    Every prompt samples with its own seed (the run's seed and the prompt id) and batches are planned over all of
    `prompts`, so a run resumed after an interruption writes the same responses as one that never stopped.
    """
    done = done_ids(path) if done is None else done
    todo = [p for p in prompts if p.id not in done]
    answered = len(prompts) - len(todo)
    log.info("self-generation: %d prompts, %d already answered, %d to go", len(prompts), answered, len(todo))
    start = time.perf_counter()
    if todo and settings.backend == "vllm":
        _generate_vllm(model, tokenizer, todo, settings, path, seed, engine or EngineSettings())
    elif todo:
        _generate_hf(model, tokenizer, prompts, done, settings, path, seed)
    return {
        "prompts": len(prompts),
        "resumed_from": len(prompts) - len(todo),
        "generated": len(todo),
        "seconds": round(time.perf_counter() - start, 1),
    }


def _generate_hf(
    model: Any,
    tokenizer: Any,
    prompts: list[Prompt],
    done: set[str],
    settings: GenerationSection,
    path: Path,
    seed: int,
) -> None:
    from layerprune.models.generate import generate_ids  # torch and transformers only when generating

    texts = {p.id: prompt_text(tokenizer, p.text, settings) for p in prompts}
    ordered = sorted(prompts, key=lambda p: (len(encode_prompt(tokenizer, texts[p.id], settings)), p.id))
    sampling = sampling_settings(model.generation_config, settings)
    batches = [ordered[i : i + settings.batch_size] for i in range(0, len(ordered), settings.batch_size)]
    for number, batch in enumerate(batches, 1):
        if all(p.id in done for p in batch):
            continue
        seeded = [SeededSampler([prompt_seed(seed, [p.id]) for p in batch], sampling)] if sampling["do_sample"] else []
        rows = generate_ids(
            model,
            tokenizer,
            [texts[p.id] for p in batch],
            settings.max_new_tokens,
            stop_strings=[] if settings.chat_template else [settings.stop],
            add_special_tokens=not settings.chat_template,
            logits_processor=seeded,
        )
        _append(
            path,
            (_record(p, tokenizer, ids, settings) for p, ids in zip(batch, rows, strict=False) if p.id not in done),
        )
        log.info("  answered batch %d/%d", number, len(batches))


class SeededSampler:
    """Hugging Face's sampling warpers (temperature, top-k, top-p, min-p, in generate's order) with one random
    generator per prompt: a response does not depend on the batch it was drawn in or on the global RNG.
    Used as a logits processor of greedy decoding: it returns the drawn token as the only possible one."""

    def __init__(self, seeds: list[int], sampling: dict[str, Any]) -> None:
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.seeds, self.generators = seeds, None
        self.warpers = [TemperatureLogitsWarper(sampling["temperature"])] if sampling["temperature"] != 1.0 else []
        if sampling.get("top_k"):
            self.warpers.append(TopKLogitsWarper(sampling["top_k"]))
        if sampling["top_p"] < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling["top_p"]))
        if sampling.get("min_p") is not None:
            self.warpers.append(MinPLogitsWarper(sampling["min_p"]))

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self.generators is None:
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1)
        drawn = torch.stack(
            [torch.multinomial(row, 1, generator=g) for row, g in zip(probs, self.generators, strict=False)]
        )
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)


def _record(prompt: Prompt, tokenizer: Any, ids: list[int], settings: GenerationSection) -> dict[str, Any]:
    """One responses-file row from the new token ids of a prompt (already cut before the end token)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if settings.chat_template:
        return {
            "id": prompt.id,
            "prompt": prompt.text,
            "answer": prompt.answer,
            "response": text.strip(),
            "tokens": len(ids),
            "truncated": len(ids) >= settings.max_new_tokens,
        }
    answer, stopped = cut_at_stop(text, settings.stop)  # the answer is the text before the stop, as scored
    return {
        "id": prompt.id,
        "prompt": prompt.text,
        "answer": prompt.answer,
        "response": answer,
        "tokens": len(tokenizer(plain_completion(answer, settings), add_special_tokens=False)["input_ids"]),
        "truncated": not stopped and len(ids) >= settings.max_new_tokens,
    }


def _append(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    drop_torn_tail(path)
    with path.open("a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        handle.flush()


def drop_torn_tail(path: Path) -> None:
    """Cut a half-written last line (an interrupted append) so the next row starts on its own line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as handle:
        data = handle.read()
        if not data.endswith(b"\n"):
            handle.truncate(data.rfind(b"\n") + 1)


def check_vllm() -> None:
    """vLLM must be importable for `--backend vllm`."""
    require_vllm()


VLLM_CHUNK = 256  # prompts per llm.generate call: the responses file grows as they finish


def vllm_engine(prompt_tokens: int, settings: GenerationSection, seed: int, engine: EngineSettings) -> EngineSettings:
    """The engine for these prompts: the run's dtype and seed, a context just long enough, a memory share that
    leaves the rest of the GPU to training, and no more sequences at once than generate.batch_size allows."""
    return dataclasses.replace(engine, seed=seed, max_model_len=prompt_tokens + settings.max_new_tokens,
                               max_num_seqs=settings.batch_size, gpu_memory=settings.vllm_gpu_memory)


def vllm_sampling_args(sampling: dict[str, Any], settings: GenerationSection, seed: int) -> dict[str, Any]:
    """vllm.SamplingParams' arguments equal to the Hugging Face path's `sampling_settings` (per-prompt seed)."""
    stop = {} if settings.chat_template else {"stop": [settings.stop]}
    if not sampling.get("do_sample"):
        return {"temperature": 0.0, "max_tokens": settings.max_new_tokens, "seed": seed, **stop}
    return {
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
        "top_k": sampling.get("top_k") or -1,
        "repetition_penalty": sampling.get("repetition_penalty", 1.0),
        "min_p": sampling.get("min_p", 0.0),
        "max_tokens": settings.max_new_tokens,
        "seed": seed,
        **stop,
    }


def _generate_vllm(
    model: Any,
    tokenizer: Any,
    prompts: list[Prompt],
    settings: GenerationSection,
    path: Path,
    seed: int,
    engine: EngineSettings,
) -> None:
    from transformers import GenerationConfig
    from vllm import SamplingParams  # type: ignore[import-not-found]

    ids = [
        encode_prompt(tokenizer, prompt_text(tokenizer, p.text, settings), settings) for p in prompts
    ]  # a template already holds the BOS: vLLM must not add a second
    try:
        generation_config = GenerationConfig.from_pretrained(str(model))
    except OSError:
        generation_config = GenerationConfig()
    sampling = sampling_settings(generation_config, settings)
    llm = start_llm(str(model), vllm_engine(max(map(len, ids)), settings, seed, engine))
    try:
        for first in range(0, len(prompts), VLLM_CHUNK):
            chunk = prompts[first : first + VLLM_CHUNK]
            params = [
                SamplingParams(**vllm_sampling_args(sampling, settings, prompt_seed(seed, [p.id]))) for p in chunk
            ]
            outputs = llm.generate([{"prompt_token_ids": t} for t in ids[first : first + VLLM_CHUNK]], params)
            _append(
                path,
                [
                    {
                        "id": p.id,
                        "prompt": p.text,
                        "answer": p.answer,
                        "response": o.outputs[0].text.strip() if settings.chat_template else o.outputs[0].text,
                        "tokens": len(o.outputs[0].token_ids),
                        "truncated": o.outputs[0].finish_reason == "length",
                    }
                    for p, o in zip(chunk, outputs, strict=False)
                ],
            )
    finally:
        shutdown_llm(llm)


def filter_responses(
    rows: list[dict[str, Any]], settings: GenerationSection
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Apply the recipe's filters; the card counts what each filter removed."""
    card = {"responses": len(rows), "empty": 0, "truncated": 0, "too_long": 0, "wrong": 0}
    kept = []
    for row in rows:
        reason = _drop_reason(row, settings)
        if reason:
            card[reason] += 1
        else:
            kept.append(row)
    card["kept"] = len(kept)
    if not kept:
        raise LayerpruneError(
            f"every response was filtered away ({_describe(card)}); loosen generate.filter, "
            "generate.max_response_tokens or generate.drop_truncated"
        )
    return kept, card


def _drop_reason(row: dict[str, Any], settings: GenerationSection) -> str | None:
    if not row["response"].strip():
        return "empty"
    if settings.drop_truncated and row.get("truncated"):
        return "truncated"
    if settings.max_response_tokens and row.get("tokens", 0) > settings.max_response_tokens:
        return "too_long"
    if settings.filter == "correct" and not is_correct(row["response"], row.get("answer")):
        return "wrong"
    return None


def _describe(card: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in card.items() if v)


def responses_for(prompts: list[Prompt], path: Path) -> list[dict[str, Any]]:
    """The answered rows of these prompts, in prompt order (later duplicates ignored)."""
    wanted = {p.id for p in prompts}
    rows: dict[str, dict[str, Any]] = {}
    for row in iter_jsonl(path):
        if row.get("id") in wanted and row["id"] not in rows:
            rows[row["id"]] = row
    return [rows[p.id] for p in prompts if p.id in rows]
