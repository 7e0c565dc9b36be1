"""Recovery prompts from any source, task-aligned ones from the probe generators, never the evaluation items.

`prompts.source: probes` (every probe task) or `probes:arith_1dc+brackets_d3` draws few-shot probe questions from
the generators on this module's own seed stream ('recover-<shuffle_seed>'), which the evaluation never uses. Then,
whatever the source, any prompt that asks one of the first EVAL_ITEMS items of a probe task (under the evaluation
seeds in `prompts.exclude_probe_seeds`) anywhere in its text, as its question or in a few-shot example (a scored item
solved in the context is still the item in view), or is a GSM8K test question, is dropped, and the count is reported.
An item is asked where its payload stands: the unit the contamination audit matches (tasks/contamination.py: '50 + 31
=' is the item '31 + 50 =', 'Input: k d m\nCopy:' holds the list k d m), so the exclusion drops exactly what the
audit would call an exact match in the prompts.
The probe tasks and their generators are those of `layerprune.tasks.probes`, which evaluate uses too: one list, so a new
probe task is excluded here as soon as it is evaluated.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import unknown_name_message
from layerprune.recover import selfgen
from layerprune.recover.schema import PromptSource
from layerprune.tasks import probes
from layerprune.tasks.contamination import Payload, find_payloads, item_payload
from layerprune.tasks.data import HUB_DATASETS, HUB_SOURCE, local_split, parse_hub_source, read_jsonl, resolve_data_dir
from layerprune.tasks.probes import PROBE_DOCS, Probe

log = logging.getLogger(__name__)
GSM8K_HUB = HUB_DATASETS["gsm8k"][0]  # the hub repo whose test split evaluate scores
EVAL_ITEMS = PROBE_DOCS  # evaluate generates this many items per probe task; --limit takes the first ones


def generate_probes(task: str, n: int, seed: int | str) -> list[Probe]:
    """The first `n` questions of a probe task under `seed` (an int for evaluation, a string namespace here)."""
    return probes.generate_probes(probes.probe_tasks()[task], n, seed)  # type: ignore[arg-type]


def probe_task_names(source: str) -> list[str] | None:
    """The probe tasks a `probes[:a+b]` source names (None: not a probe source)."""
    if source != "probes" and not source.startswith("probes:"):
        return None
    known = probes.probe_tasks()
    names = list(known) if source == "probes" else [n.strip() for n in source.split(":", 1)[1].split("+") if n.strip()]
    for name in names:
        if name not in known:
            raise LayerpruneError(unknown_name_message("probe task", name, list(known)))
    if not names:
        raise LayerpruneError(f"prompt source '{source}' names no probe task")
    return names


def draw_probes(names: list[str], n: int, seed: int) -> list[Probe]:
    """`n` probes, round-robin over the tasks, on the recovery seed stream, a repeated prompt once."""
    per_task = -(-n // len(names))
    drawn = {name: generate_probes(name, per_task, f"recover-{seed}") for name in names}
    ordered = [drawn[name][i] for i in range(per_task) for name in names if i < len(drawn[name])][:n]  # small
    # tasks (brackets_d2 has 9 distinct questions) run out first
    unique: dict[str, Probe] = {}
    for probe in ordered:  # the first occurrence of a repeated question wins
        unique.setdefault(selfgen.prompt_id(probe.prompt), probe)
    return list(unique.values())


def probe_prompts(names: list[str], n: int, seed: int) -> list[selfgen.Prompt]:
    """`n` probe prompts, round-robin over the tasks, on the recovery seed stream."""
    return [as_prompt(probe) for probe in draw_probes(names, n, seed)]


def as_prompt(probe: Probe) -> selfgen.Prompt:
    return selfgen.Prompt(selfgen.prompt_id(probe.prompt), probe.prompt, probe.answer.strip())


@functools.lru_cache(maxsize=8)
def scored_payloads(seeds: tuple[int, ...]) -> frozenset[Payload]:
    """The payloads (tasks/contamination.py) of the first EVAL_ITEMS items of every probe task under each evaluation
    seed."""
    found = (item_payload(p.question, probes.family_of(task)) for seed in seeds
             for task, args in probes.probe_tasks().items() for p in probes.generate_probes(args, EVAL_ITEMS, seed))
    return frozenset(payload for payload in found if payload is not None)


def asks_scored_item(text: str, seeds: tuple[int, ...]) -> bool:
    """Whether a prompt asks a scored probe item anywhere (its question or a few-shot example)."""
    return not scored_payloads(seeds).isdisjoint(find_payloads(text))


def prompts_of_task(task: str, wanted: int, seed: int = 0) -> set[str]:
    """Every prompt text `probe_prompts` can draw from `task` for up to `wanted` prompts (its redraws included)."""
    return {p.prompt for p in generate_probes(task, 64 * max(wanted, 1), f"recover-{seed}")}


def gsm8k_test_questions(data_dir: Path | None) -> set[str]:
    path = local_split(data_dir, "gsm8k", "test")
    return {str(row.get("question", "")).strip() for row in read_jsonl(path)} if path is not None else set()


def is_gsm8k(source: str) -> bool:
    """Whether a prompt source is GSM8K, by its name or its hub id (hf:openai/gsm8k[:CONFIG])."""
    return source == "gsm8k" or (source.startswith(HUB_SOURCE) and parse_hub_source(source)[0] == GSM8K_HUB)


def prompts_data_dir(source: PromptSource, data_dir: Path | str | None) -> Path | None:
    """The data mirror a prompt source is read from: none for a .jsonl file of the user's, else `data_dir`
    resolved (the mirror's default where it names none)."""
    return None if source.source.endswith(".jsonl") else resolve_data_dir(data_dir)


def load_prompts(source: PromptSource, data_dir: Path | None) -> tuple[list[selfgen.Prompt], dict[str, int]]:
    """The recipe's prompts minus every evaluation item; the card says how many were excluded."""
    if source.split == "test" and is_gsm8k(source.source):
        raise LayerpruneError(f"prompts from {source.source}/test are the evaluation items (gsm8k's test split); use "
                              "split 'train'")
    names = probe_task_names(source.source)
    wanted, seeds, gsm8k_test = source.samples or 256, tuple(source.exclude_probe_seeds), gsm8k_test_questions(data_dir)
    if not gsm8k_test and names is None:
        log.warning("no local gsm8k/test split: GSM8K test questions among the prompts cannot be excluded")
    if names is None:
        kept, card = exclude_eval_items(selfgen.load_prompts(source, data_dir), seeds, gsm8k_test)
    else:  # draw more until the exclusion leaves `samples` (small tasks such as brackets_d2 are all evaluation items)
        drawn = 2 * wanted
        kept, card = exclude_eval_items(probe_prompts(names, drawn, source.shuffle_seed), seeds, gsm8k_test)
        while len(kept) < wanted and drawn < 64 * wanted:
            drawn *= 2
            kept, card = exclude_eval_items(probe_prompts(names, drawn, source.shuffle_seed), seeds, gsm8k_test)
        kept = kept[:wanted]
        card["kept"] = len(kept)
    if not kept:
        raise LayerpruneError(f"every prompt of '{source.source}' is an evaluation item; choose other prompts")
    return kept, card


def exclude_eval_items(prompts: list[selfgen.Prompt], seeds: tuple[int, ...],
                       gsm8k_test: set[str]) -> tuple[list[selfgen.Prompt], dict[str, int]]:
    """Drop prompts that ask a probe evaluation item anywhere (`asks_scored_item`) or are a GSM8K test question."""
    kept, card = [], {"prompts": len(prompts), "excluded_probe_eval": 0, "excluded_gsm8k_test": 0}
    for prompt in prompts:
        if asks_scored_item(prompt.text, seeds):
            card["excluded_probe_eval"] += 1
        elif prompt.text.strip() in gsm8k_test:
            card["excluded_gsm8k_test"] += 1
        else:
            kept.append(prompt)
    if card["excluded_probe_eval"] or card["excluded_gsm8k_test"]:
        log.info("excluded %d probe evaluation and %d GSM8K test prompts from recovery", card["excluded_probe_eval"],
                 card["excluded_gsm8k_test"])
    card["kept"] = len(kept)
    return kept, card
