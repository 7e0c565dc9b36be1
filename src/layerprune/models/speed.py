"""Tokens per second of a model on this machine: a forward pass over a fixed batch, and greedy decoding.

`measure_throughput` times `generate` (what a user of the pruned model sees, per-step overhead included);
`measure_speed` and `measured_speedup` are the short fixed benchmark of pruning to a speed target: the model's
own prefill and KV-cached decode steps, the candidate (the blocks actually dropped, `skipped_blocks`; or the
sublayers removed as the Nemotron-NAS layout runs them, `measured_sublayer_speedup`) timed alternately with the
original so that a machine whose load drifts slows both alike. `profile_parts` times each removable part inside
one run of that benchmark (forward hooks), so that a speedup can be predicted for any set of removals from the
time they take rather than from their FLOPs alone.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from layerprune.models.blocks import skipped_blocks
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


@dataclass(frozen=True)
class SpeedBench:
    """The fixed benchmark: prefill of `batch` random prompts of `prompt_len` tokens (no cache, the last position's
    logits), then `new_tokens` greedy decode steps of one row with the KV cache; each timed `repeats` times, the
    fastest kept. `clock="cpu"` times this process's CPU seconds instead of the wall clock: a fair count of the
    work on a CPU shared with other loads (never on an accelerator, whose work it does not see)."""

    prompt_len: int = 128
    batch: int = 1
    new_tokens: int = 16
    repeats: int = 3
    clock: Literal["wall", "cpu"] = "wall"

    def __post_init__(self) -> None:
        if min(self.prompt_len, self.batch, self.new_tokens, self.repeats) < 1:
            raise ValueError(f"a speed benchmark needs at least one of each: {self}")


DEFAULT_BENCH = SpeedBench()


@dataclass(frozen=True)
class Speed:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def measure_speed(model: Any, bench: SpeedBench = DEFAULT_BENCH) -> Speed:
    """Prefill and decode tokens/s of `model` as it is now, on its own device and dtype."""
    ids = _prompt_ids(model, bench)
    with torch.inference_mode():
        _prefill(model, ids[:, :8], bench.clock)  # warm-up
        prefill = min(_prefill(model, ids, bench.clock) for _ in range(bench.repeats))
        decode = min(_decode(model, ids[:1], bench.new_tokens, bench.clock) for _ in range(bench.repeats))
    return Speed(ids.numel() / prefill, bench.new_tokens / decode)


def measured_speedup(model: Any, drop: Sequence[int], bench: SpeedBench = DEFAULT_BENCH) -> dict[str, float]:
    """The model with the blocks `drop` removed against the model whole: tokens/s of each (prefill and decode) and
    the ratios; `speedup` is the smaller ratio (a target is met when both phases are that much faster)."""
    return _speedup(model, model, lambda: skipped_blocks(model, list(drop)), bench)


def measured_sublayer_speedup(model: Any, removed: Sequence[Any],
                              bench: SpeedBench = DEFAULT_BENCH) -> dict[str, float]:
    """The model without the `removed` attention / MLP sublayers as the Nemotron-NAS layout runs them (a DeciLM model
    sharing the kept weights, nothing copied: `to_nas`) against the model whole, as `measured_speedup` reports."""
    from layerprune.models.nas_surgery import to_nas

    return _speedup(model, to_nas(model, list(removed)), contextlib.nullcontext, bench)


def measured_removal_speedup(model: Any, removals: Sequence[Any],
                             bench: SpeedBench = DEFAULT_BENCH) -> dict[str, float]:
    """`measured_speedup` for whole blocks (ints), `measured_sublayer_speedup` for attention / MLP sublayers: each
    removal timed as its saved model runs."""
    if all(isinstance(r, int) for r in removals):
        return measured_speedup(model, [int(r) for r in removals], bench)
    return measured_sublayer_speedup(model, removals, bench)


def _speedup(model: Any, candidate: Any, candidate_context: Callable[[], Any], bench: SpeedBench) -> dict[str, float]:
    """`candidate` (run inside `candidate_context()`) timed alternately with `model` on the same prompts."""
    ids = _prompt_ids(model, bench)
    times: dict[str, list[float]] = {key: [] for key in ("prefill", "decode", "prefill_new", "decode_new")}
    runs = (("", model, contextlib.nullcontext), ("_new", candidate, candidate_context))
    with torch.inference_mode():
        for _, runner, context in runs:  # warm-up, each model once
            with context():
                _prefill(runner, ids[:, :8], bench.clock)
        for _ in range(bench.repeats):
            for suffix, runner, context in runs:
                with context():
                    times["prefill" + suffix].append(_prefill(runner, ids, bench.clock))
                    times["decode" + suffix].append(_decode(runner, ids[:1], bench.new_tokens, bench.clock))
    best = {key: min(values) for key, values in times.items()}
    result = {
        "prefill_tokens_per_s": ids.numel() / best["prefill"],
        "decode_tokens_per_s": bench.new_tokens / best["decode"],
        "prefill_tokens_per_s_pruned": ids.numel() / best["prefill_new"],
        "decode_tokens_per_s_pruned": bench.new_tokens / best["decode_new"],
        "prefill_speedup": best["prefill"] / best["prefill_new"],
        "decode_speedup": best["decode"] / best["decode_new"],
    }
    return {**result, "speedup": min(result["prefill_speedup"], result["decode_speedup"])}


@dataclass(frozen=True)
class SpeedProfile:
    """Seconds the fixed benchmark's prefill and decode spent in the whole model (`totals`) and inside each
    removable part (`parts`: key -> phase -> seconds), summed over its repeats, all on one clock."""

    totals: dict[str, float]
    parts: dict[Hashable, dict[str, float]]

    def speedup(self, keys: Iterable[Hashable]) -> dict[str, float]:
        """Predicted prefill and decode speedups without the parts `keys` (1 / the share of time left), and their
        smaller as `speedup`, as `measured_speedup` reports a measurement."""
        keys = list(keys)
        ratios = {f"{phase}_speedup": total / max(total - sum(self.parts[k][phase] for k in keys), 1e-12 * total)
                  for phase, total in self.totals.items()}
        return {**ratios, "speedup": min(ratios.values())}


PHASES = ("prefill", "decode")


def profile_parts(model: Any, parts: Mapping[Hashable, Sequence[torch.nn.Module]],
                  bench: SpeedBench = DEFAULT_BENCH) -> SpeedProfile:
    """Time each part (key -> the modules it removes, e.g. a block, or an attention and the norm before it) inside
    the fixed benchmark's prefill and decode of `model`, with forward hooks; `bench.repeats` runs summed. A device
    with asynchronous work is synchronised at each hook, so there the parts' times include their launches."""
    device = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    now = time.process_time if bench.clock == "cpu" else time.perf_counter
    seconds: dict[Hashable, dict[str, float]] = {key: dict.fromkeys(PHASES, 0.0) for key in parts}
    phase = {"name": "warm-up"}
    started: dict[tuple[Hashable, int], float] = {}

    def hooks(key: Hashable, module: torch.nn.Module) -> list[Any]:
        def before(*_: Any) -> None:
            sync()
            started[key, id(module)] = now()

        def after(*_: Any) -> None:
            sync()
            if phase["name"] in PHASES:
                seconds[key][phase["name"]] += now() - started.pop((key, id(module)))

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    totals = dict.fromkeys(PHASES, 0.0)
    ids = _prompt_ids(model, bench)
    handles: list[Any] = []
    try:
        handles += [h for key, modules in parts.items() for module in modules for h in hooks(key, module)]
        with torch.inference_mode():
            _prefill(model, ids[:, :8], bench.clock)  # warm-up
            for _ in range(bench.repeats):
                phase["name"] = "prefill"
                totals["prefill"] += _prefill(model, ids, bench.clock)
                phase["name"] = "decode-prompt"  # the decode's own prompt pass is not a decode step
                totals["decode"] += _decode(model, ids[:1], bench.new_tokens, bench.clock, on_steps=phase)
    finally:
        for handle in handles:
            handle.remove()
    return SpeedProfile(totals, seconds)


def _prompt_ids(model: Any, bench: SpeedBench) -> torch.Tensor:
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    return torch.randint(10, max(11, min(vocab, 30000)), (bench.batch, bench.prompt_len), generator=generator).to(
        model.device
    )


def _prefill(model: Any, ids: torch.Tensor, clock: str = "wall") -> float:
    """Seconds for one forward over the prompts, logits of the last position only (as generation's prefill)."""
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    return _timed(lambda: model(input_ids=ids, use_cache=False, **last), ids.device, clock)


def _decode(model: Any, prompt: torch.Tensor, steps: int, clock: str = "wall",
            on_steps: dict[str, str] | None = None) -> float:
    """Seconds for `steps` greedy steps after the prompt, each one token through the KV cache (`on_steps`, a
    profile's phase, is set to "decode" once the prompt's own pass is done)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=prompt, use_cache=True)
    if on_steps is not None:
        on_steps["name"] = "decode"
    cache = out.get("cache", out.get("past_key_values"))  # the output's name follows transformers' version
    state = {"cache": cache, "next": out.logits[:, -1:].argmax(-1)}

    def run() -> None:
        for _ in range(steps):
            out = model(input_ids=state["next"], use_cache=True, **{name: state["cache"]})
            state["cache"], state["next"] = out[name], out.logits[:, -1:].argmax(-1)

    return _timed(run, prompt.device, clock)


def _timed(fn: Callable[[], Any], device: Any = None, clock: str = "wall") -> float:
    now = time.process_time if clock == "cpu" else time.perf_counter
    _sync(device)
    start = now()
    fn()
    _sync(device)
    return now() - start


def _sync(device: Any) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
