"""Ablating every block: prefix reuse (analyze/prune) vs the naive loop (a full forward per skipped block).

Both run side by side in one process on the same batches; the script prints both times, the ratio
and the largest difference between the two sets of NLLs (they must agree).

    .venv/bin/python bench/bench_analyze.py                      # SmolLM2-135M (embedded), 16 arithmetic items
    .venv/bin/python bench/bench_analyze.py --model embedded:gemma3-270m --task factual --samples 32
"""

from __future__ import annotations

import argparse
import time

import torch

from layerprune.analyze.tasks import task_items
from layerprune.analyze.walk import ablate_blocks, ablate_blocks_naive, build_batches
from layerprune.models import find_decoder_stack, load_model
from layerprune.tasks.data import resolve_data_dir


def timed(fn, *args):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    loaded = load_model(args.model)
    items = task_items(args.task, args.samples, 0, 3, resolve_data_dir(None))
    batches = build_batches(loaded.tokenizer, items, args.batch_size, 512)
    depth = len(find_decoder_stack(loaded.model))
    tokens = sum(int(b.attention_mask.sum()) for b in batches)
    ablate_blocks(loaded.model, batches[:1])  # warm-up
    fast_s = naive_s = 0.0
    for _ in range(args.repeats):
        naive, seconds = timed(ablate_blocks_naive, loaded.model, batches)
        naive_s += seconds
        fast, seconds = timed(ablate_blocks, loaded.model, batches)
        fast_s += seconds
    diff = max(abs(a - b) for a, b in zip(fast.ablated_nll, naive.ablated_nll, strict=False))
    print(f"model {args.model}: {depth} blocks, task {args.task}, {len(items)} items, {tokens} tokens, "
          f"torch threads {torch.get_num_threads()}")
    print(f"naive loop (full forward per skipped block): {naive_s / args.repeats:.2f} s")
    print(f"prefix reuse (cached block inputs):          {fast_s / args.repeats:.2f} s")
    print(f"speed-up: {naive_s / fast_s:.2f}x  (max |NLL difference| {diff:.2e})")


if __name__ == "__main__":
    main()
