"""lm-eval task configs for this project's tasks: algorithmic probes and HumanEval+ run in our sandbox."""

from __future__ import annotations

import copy
import functools
import json
import secrets
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.evaluate.humaneval import (
    GT_TIME_LIMIT_FACTOR,
    MIN_TIME_LIMIT,
    Oracle,
    check_completion,
    check_program,
    count_statuses,
    expected_outputs,
    pass_at_k,
)
from layerprune.evaluate.sandbox import SandboxLimits
from layerprune.evaluate.task_specs import TaskSpec
from layerprune.tasks.data import load_rows
from layerprune.tasks.grading import last_boxed, numbers_equal
from layerprune.tasks.probes import PROBE_DOCS, PROBE_SHOTS, PROBE_VERSION, Probe, generate_probes

PROBE_MAX_TOKENS = 32
# lm-eval's humaneval.yaml, with its hub-loaded code_eval metric replaced by our sandbox
HUMANEVAL_STOPS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
HUMANEVAL_TOP_P = 0.95  # lm-eval's humaneval_64.yaml
DEFAULT_TEMPERATURE = 0.2  # lm-eval's sampled configs (humaneval_64, gsm8k-cot-self-consistency)
PASS_KS = (1, 10)


@dataclass(frozen=True)
class Sampling:
    """N completions per document, sampled at a temperature: scored as pass@k (and maj@N where answers vote)."""

    n: int
    temperature: float


def sampled_ks(n: int) -> list[int]:
    """The k of pass@k reported for n samples: 1, and 10 where n >= 10."""
    return [k for k in PASS_KS if k <= n]


def sampled_metrics(n: int, majority: bool) -> list[dict[str, Any]]:
    names = [f"pass@{k}" for k in sampled_ks(n)] + ([f"maj@{n}"] if majority else [])
    return [{"metric": name, "aggregation": "mean", "higher_is_better": True} for name in names]


def with_sampling(config: dict[str, Any], sampling: Sampling, majority: bool, top_p: float | None = None,
                  keep: tuple[str, ...] = ("status", "check")) -> dict[str, Any]:
    """The same task, generating `sampling.n` completions per document (lm-eval `repeats`), all kept for scoring."""
    gen = {**config["generation_kwargs"], "do_sample": True, "temperature": sampling.temperature}
    if top_p is not None:
        gen["top_p"] = top_p
    kept = [m for m in config["metric_list"] if m["metric"] in keep]
    return {**config, "repeats": sampling.n, "generation_kwargs": gen,
            "filter_list": [{"name": "none", "filter": [{"function": "take_first_k", "k": sampling.n}]}],
            "metric_list": sampled_metrics(sampling.n, majority) + kept}


def sampled_scores(answers: list[str], gold: str, majority: bool) -> dict[str, float]:
    """pass@k (unbiased) over N answers, and whether the most common answer (first seen on a tie) is right."""
    correct = sum(a == gold for a in answers)
    scores = {f"pass@{k}": pass_at_k(len(answers), correct, k) for k in sampled_ks(len(answers))}
    if majority:
        scores[f"maj@{len(answers)}"] = float(Counter(answers).most_common(1)[0][0] == gold)
    return scores


def probe_rows(spec: TaskSpec, seed: int, n: int = PROBE_DOCS) -> list[Probe]:
    """The deterministic questions of a probe task (distinct ones: fewer than `n` where the family has fewer)."""
    return generate_probes(spec.probe, n, seed)


def score_exact(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    """Exact match of the first generated line against the answer (surrounding spaces ignored); pass@k and
    maj@N when N answers were sampled."""
    if isinstance(results[0], list):
        return sampled_scores([r.strip() for r in results[0]], doc["answer"].strip(), majority=True)
    return {"exact_match": float(results[0].strip() == doc["answer"].strip())}


def _dataset(rows: list[dict[str, Any]], **_: Any) -> dict[str, Any]:
    import datasets

    return {"test": datasets.Dataset.from_list(rows)}


def probe_messages(probe: Probe) -> list[dict[str, str]]:
    """A probe as chat turns, as lm-eval's `fewshot_as_multiturn` builds them: each few-shot example a user turn (its
    question) and an assistant turn (its answer, surrounding spaces dropped), then the question as the last user
    turn."""
    turns = [turn for q, a in probe.examples for turn in ({"role": "user", "content": q},
                                                           {"role": "assistant", "content": a.strip()})]
    return [*turns, {"role": "user", "content": probe.question}]


def chat_prompt(probe: Probe, tokenizer: Any) -> str:
    """A probe rendered through the tokenizer's chat template (`probe_messages`, then the generation prompt), the
    text lm-eval generates from under probe_format chat."""
    if not getattr(tokenizer, "chat_template", None):
        raise LayerpruneError("probe_format chat needs a model with a chat template; this tokenizer has none")
    return str(tokenizer.apply_chat_template(probe_messages(probe), tokenize=False, add_generation_prompt=True))


def probe_shots_sampler() -> type:
    """lm-eval's few-shot sampler for probe_format chat: each document's own examples (its `shots` column), in order."""
    from lm_eval.api.samplers import ContextSampler

    class ProbeShots(ContextSampler):  # type: ignore[misc]
        def sample(self, n: int, eval_doc: dict[str, Any] | None = None, df: Any = None,
                   **kwargs: Any) -> list[dict[str, Any]]:
            if eval_doc is None or len(eval_doc["shots"]) < n:
                raise LayerpruneError(f"a probe document carries {PROBE_SHOTS} examples; {n} were asked for")
            return list(eval_doc["shots"])[:n]

    return ProbeShots


def chat_probe_config(config: dict[str, Any], probes: list[Probe]) -> dict[str, Any]:
    """probe_format chat: lm-eval renders each document's own examples as prior turns (its apply_chat_template with
    fewshot_as_multiturn, which the runner turns on) and the question as the last user turn; scored as plain."""
    rows = [{"prompt": p.prompt, "answer": p.answer, "question": p.question, "target": p.answer.strip(),
             "shots": [{"question": q, "target": a.strip()} for q, a in p.examples]} for p in probes]
    return {**config, "custom_dataset": functools.partial(_dataset, rows), "doc_to_text": "{{question}}",
            "doc_to_target": "{{target}}", "num_fewshot": PROBE_SHOTS, "fewshot_split": "test",
            "fewshot_config": {"sampler": probe_shots_sampler()}, "fewshot_delimiter": "\n",
            "metadata": {**config["metadata"], "probe_format": "chat"}}


def probe_config(spec: TaskSpec, seed: int, sampling: Sampling | None = None,
                 probe_format: str = "plain") -> dict[str, Any]:
    """The lm-eval config of a probe task: plain few-shot text (the prompt whole, zero-shot to lm-eval), or with
    probe_format chat the examples as chat turns (`chat_probe_config`)."""
    probes = probe_rows(spec, seed)
    rows = [{"prompt": p.prompt, "answer": p.answer} for p in probes]
    config = {
        "task": spec.name, "custom_dataset": functools.partial(_dataset, rows), "test_split": "test",
        "output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
        "target_delimiter": "", "num_fewshot": 0, "process_results": score_exact,
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": PROBE_MAX_TOKENS, "do_sample": False},
        "metadata": {"version": float(PROBE_VERSION), "seed": seed},
    }
    if probe_format == "chat":
        config = chat_probe_config(config, probes)
    return with_sampling(config, sampling, majority=True) if sampling else config


def humaneval_program(doc: dict[str, Any], completion: str, oracle: Oracle | None = None) -> str:
    """The program that checks `completion` on every HumanEval+ input (see evaluate.humaneval for the verdict)."""
    oracle = oracle or expected_outputs([doc], None)[doc["task_id"]]
    return check_program(doc, completion, oracle, f"layerprune-check-{secrets.token_hex(8)}")


class HumanEvalScorer:
    """lm-eval's process_results for HumanEval+ (not a partial or dataclass: lm-eval's config dump would spell out
    every expected output, and ints past 4300 digits make that dump fail)."""

    def __init__(self, oracles: dict[str, Oracle], limits: SandboxLimits) -> None:
        self.oracles, self.limits = oracles, limits

    def __call__(self, doc: dict[str, Any], results: list[Any]) -> dict[str, Any]:
        return score_humaneval(self.oracles, self.limits, doc, results)

    def __repr__(self) -> str:
        return f"HumanEvalScorer(EvalPlus rules, {len(self.oracles)} problems, {self.limits})"


class RowsDataset:
    """lm-eval's custom_dataset: the rows as a `test` split (its repr does not spell out every row)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __call__(self, **_: Any) -> dict[str, Any]:
        return _dataset(self.rows)

    def __repr__(self) -> str:
        return f"RowsDataset({len(self.rows)} rows)"


def score_humaneval(oracles: dict[str, Oracle], limits: SandboxLimits, doc: dict[str, Any],
                    results: list[Any]) -> dict[str, Any]:
    """pass@1 of one greedy completion, or the unbiased pass@k of N sampled ones; each run's sandbox status."""
    sampled = isinstance(results[0], list)
    completions = results[0] if sampled else [results[0]]
    verdicts = [check_completion(doc, c, oracles[doc["task_id"]], limits) for c in completions]
    statuses, details = [v.status for v in verdicts], [f"{v.detail} ({v.seconds:.2f}s)" for v in verdicts]
    if not sampled:
        return {"pass@1": float(verdicts[0].passed), "status": statuses[0], "check": details[0]}
    correct = sum(v.passed for v in verdicts)
    scores = {f"pass@{k}": pass_at_k(len(verdicts), correct, k) for k in sampled_ks(len(verdicts))}
    return {**scores, "status": statuses, "check": details}


def humaneval_rows(data_dir: Path | None) -> list[dict[str, Any]]:
    """HumanEval+ rows flattened to strings (their inputs mix types, which Arrow cannot hold)."""
    rows = load_rows("humaneval_plus", "test", data_dir)
    return [{"task_id": r["task_id"], "prompt": r["prompt"], "entry_point": r["entry_point"],
             "reference": r["canonical_solution"], "test": r["test"], "atol": float(r.get("atol") or 0),
             "inputs": json.dumps(list(r.get("base_input") or []) + list(r.get("plus_input") or []))}
            for r in rows]


def _no_aggregate(items: list[Any]) -> None:
    return None


STATUS_METRICS = [{"metric": "status", "aggregation": count_statuses, "higher_is_better": True},
                  {"metric": "check", "aggregation": _no_aggregate, "higher_is_better": True}]


def humaneval_config(spec: TaskSpec, data_dir: Path | None, limits: SandboxLimits, cache_dir: Path | None = None,
                     sampling: Sampling | None = None) -> dict[str, Any]:
    """lm-eval's humaneval.yaml, scored by EvalPlus's rules in our sandbox (expected outputs computed once, cached)."""
    rows = humaneval_rows(data_dir)
    config = {
        "task": spec.name,
        "custom_dataset": RowsDataset(rows),
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{entry_point}}",
        "num_fewshot": 0,
        "process_results": HumanEvalScorer(expected_outputs(rows, cache_dir), limits),
        "metric_list": [{"metric": "pass@1", "aggregation": "mean", "higher_is_better": True}, *STATUS_METRICS],
        "generation_kwargs": {"until": list(HUMANEVAL_STOPS), "max_gen_toks": 1024, "do_sample": False},
        "metadata": {
            "version": 2.0,
            "sandbox": copy.copy(limits.__dict__),
            "time_limit_factor": GT_TIME_LIMIT_FACTOR,
            "min_time_limit": MIN_TIME_LIMIT,
        },
    }
    return with_sampling(config, sampling, majority=False, top_p=HUMANEVAL_TOP_P) if sampling else config


def score_sampled_match(
    target: str, match: dict[str, Any], doc: dict[str, Any], results: list[Any]
) -> dict[str, float]:
    """pass@k and maj@N of N extracted answers, each judged by the task's own exact_match settings."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.utils import apply_template

    gold = apply_template(target, doc) if isinstance(target, str) else str(target(doc))
    answers = [str(a) for a in results[0]]
    right = {
        a: bool(exact_match_hf_evaluate(predictions=[a], references=[gold], **match)["exact_match"])
        for a in set(answers)
    }
    correct = sum(right[a] for a in answers)
    scores = {f"pass@{k}": pass_at_k(len(answers), correct, k) for k in sampled_ks(len(answers))}
    scores[f"maj@{len(answers)}"] = float(right[Counter(answers).most_common(1)[0][0]])
    return scores


def lm_eval_sampling(config: dict[str, Any], sampling: Sampling) -> dict[str, Any]:
    """An lm-eval exact_match task (gsm8k) sampled N times: each filter keeps all N answers instead of the first."""
    metrics = [m for m in config.get("metric_list", []) if m.get("metric") == "exact_match"]
    if config.get("output_type") != "generate_until" or len(metrics) != 1:
        raise LayerpruneError(f"--samples-per-task scores generative exact_match tasks; {config['task']} is not one")
    match = {k: v for k, v in metrics[0].items() if k not in ("metric", "aggregation", "higher_is_better")}
    filters = config.get("filter_list") or [{"name": "none", "filter": [{"function": "take_first"}]}]
    kept = [
        {
            "name": f["name"],
            "filter": [
                {"function": "take_first_k", "k": sampling.n} if step["function"] == "take_first" else step
                for step in f["filter"]
            ],
        }
        for f in filters
    ]
    gen = {**config.get("generation_kwargs", {}), "do_sample": True, "temperature": sampling.temperature}
    return {
        **config,
        "repeats": sampling.n,
        "generation_kwargs": gen,
        "filter_list": kept,
        "process_results": functools.partial(score_sampled_match, config["doc_to_target"], match),
        "metric_list": sampled_metrics(sampling.n, majority=True),
    }


BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
BOXED_MAX_TOKENS = 1024


def score_boxed(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """1 when the last \\boxed{} answer equals the GSM8K answer (after '####') as a number."""
    return {"exact_match": float(numbers_equal(last_boxed(results[0]) or "", doc["answer"].split("####")[-1]))}


def boxed_config(spec: TaskSpec, data_dir: Path | None) -> dict[str, Any]:
    """GSM8K test, zero-shot: the question plus the boxed-answer instruction; sampled at temperature 0.9."""
    rows = [{"question": r["question"], "answer": r["answer"]} for r in load_rows("gsm8k", "test", data_dir)]
    return {
        "task": spec.name,
        "custom_dataset": RowsDataset(rows),
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{question}}\n" + BOXED_INSTRUCTION,
        "doc_to_target": "{{answer}}",
        "num_fewshot": 0,
        "process_results": score_boxed,
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "generation_kwargs": {"until": [], "max_gen_toks": BOXED_MAX_TOKENS, "do_sample": True, "temperature": 0.9},
        "metadata": {"version": 1.0, "protocol": "zero-shot chat, \\boxed{} answer, temperature 0.9"},
    }
