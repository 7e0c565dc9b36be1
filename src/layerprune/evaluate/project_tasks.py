"""lm-eval task configs for this project's tasks: algorithmic probes and HumanEval+ run in our sandbox."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any, Callable

from layerprune.data import load_rows
from layerprune.evaluate.registry import TaskSpec
from layerprune.evaluate.sandbox import SandboxLimits, run_program
from layerprune.probes import Probe, arithmetic_probes, bracket_probes

PROBE_DOCS = 500  # generated per probe task; --limit takes the first ones
PROBE_MAX_TOKENS = 32
# lm-eval's humaneval.yaml, with its hub-loaded code_eval metric replaced by our sandbox
HUMANEVAL_STOPS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def probe_rows(spec: TaskSpec, seed: int, n: int = PROBE_DOCS) -> list[Probe]:
    """The deterministic questions of a probe task."""
    args = dict(spec.probe)
    family = args.pop("family")
    if family == "brackets":
        return bracket_probes(n, depth=int(args["depth"]), seed=seed)  # type: ignore[arg-type]
    return arithmetic_probes(n, seed=seed, **args)  # type: ignore[arg-type]


def score_exact(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Exact match of the first generated line against the answer (surrounding spaces ignored)."""
    return {"exact_match": float(results[0].strip() == doc["answer"].strip())}


def _dataset(rows: list[dict[str, Any]], **_: Any) -> dict[str, Any]:
    import datasets

    return {"test": datasets.Dataset.from_list(rows)}


def probe_config(spec: TaskSpec, seed: int) -> dict[str, Any]:
    rows = [{"prompt": p.prompt, "answer": p.answer} for p in probe_rows(spec, seed)]
    return {
        "task": spec.name, "custom_dataset": functools.partial(_dataset, rows), "test_split": "test",
        "output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
        "target_delimiter": "", "num_fewshot": 0, "process_results": score_exact,
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": PROBE_MAX_TOKENS, "do_sample": False},
        "metadata": {"version": 1.0, "seed": seed},
    }


HARNESS = '''

import copy as _copy, json as _json, math as _math
_candidate = {entry_point}
_ref_ns = {{}}
exec({reference!r}, _ref_ns)
_reference = _ref_ns[{entry_point!r}]

def _same(a, b, atol):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, atol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return _math.isclose(a, b, rel_tol=1e-7, abs_tol=atol or 1e-6)
    return a == b

{test}
check(_candidate)
for _args in _json.loads({inputs!r}):
    _expected = _reference(*_copy.deepcopy(_args))
    assert _same(_candidate(*_copy.deepcopy(_args)), _expected, {atol!r}), _args
'''


def humaneval_program(doc: dict[str, Any], completion: str) -> str:
    """The candidate, then the base tests, then every HumanEval+ input checked against the reference."""
    inputs = json.loads(doc["inputs"])
    return doc["prompt"] + completion + HARNESS.format(
        entry_point=doc["entry_point"], reference=doc["prompt"] + doc["reference"], test=doc["test"],
        inputs=json.dumps(inputs), atol=float(doc["atol"] or 0),
    )


def score_program(limits: SandboxLimits, doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"pass@1": float(run_program(humaneval_program(doc, results[0]), limits).passed)}


def humaneval_rows(data_dir: Path | None) -> list[dict[str, Any]]:
    """HumanEval+ rows flattened to strings (their inputs mix types, which Arrow cannot hold)."""
    rows = load_rows("humaneval_plus", "test", data_dir)
    return [{"task_id": r["task_id"], "prompt": r["prompt"], "entry_point": r["entry_point"],
             "reference": r["canonical_solution"], "test": r["test"], "atol": float(r.get("atol") or 0),
             "inputs": json.dumps(list(r.get("base_input") or []) + list(r.get("plus_input") or []))}
            for r in rows]


def humaneval_config(spec: TaskSpec, data_dir: Path | None, limits: SandboxLimits) -> dict[str, Any]:
    scorer: Callable[..., dict[str, float]] = functools.partial(score_program, limits)
    return {
        "task": spec.name, "custom_dataset": functools.partial(_dataset, humaneval_rows(data_dir)),
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{entry_point}}", "num_fewshot": 0, "process_results": scorer,
        "metric_list": [{"metric": "pass@1", "aggregation": "mean", "higher_is_better": True}],
        "generation_kwargs": {"until": list(HUMANEVAL_STOPS), "max_gen_toks": 1024, "do_sample": False},
        "metadata": {"version": 1.0, "sandbox": copy.copy(limits.__dict__)},
    }
