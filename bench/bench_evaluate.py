"""Docs per second per task type on the embedded SmolLM2-135M, measured side by side in one run.

    .venv/bin/python bench/bench_evaluate.py [--limit 20]

Runs one classification task (arc_easy), GSM8K, one probe and HumanEval+ with the same small limit, without
the result cache, and prints seconds and documents per second for each, plus the ratios to the fastest.
"""

from __future__ import annotations

import argparse
import time

from layerprune.evaluate import EvalSettings, evaluate_model
from layerprune.models import load_model

TASKS = {"classification": "arc_easy", "generative (gsm8k)": "gsm8k", "probe": "arith_1dc",
         "code (humaneval_plus)": "humaneval_plus"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-gen-toks", type=int, default=192)
    args = parser.parse_args()
    loaded = load_model("embedded")
    rates = {}
    for kind, task in TASKS.items():
        start = time.perf_counter()
        settings = EvalSettings(tasks=[task], limit=args.limit, reuse=False, max_gen_toks=args.max_gen_toks)
        summary = evaluate_model(loaded, settings)
        seconds = time.perf_counter() - start
        head = summary.headlines()[task]
        rates[kind] = head.n / seconds
        print(f"{kind:<24} {task:<16} n={head.n:<4} {seconds:7.1f}s  {rates[kind]:6.2f} docs/s  "
              f"{head.metric}={head.value:.3f}")
    fastest = max(rates.values())
    for kind, rate in rates.items():
        print(f"{kind:<24} {fastest / rate:6.1f}x slower than the fastest")


if __name__ == "__main__":
    main()
