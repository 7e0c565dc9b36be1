"""GSM8K-style free-form answers in an accuracy ablation: every candidate in one generate call vs one call each.

    nice -n 10 python bench/bench_candidates_batched.py [--model embedded] [--items 8] [--candidates 4,13,20,25]

The same GSM8K-train calibration items (3-shot, stop at the next "Question:"), the same candidates (the full model
and the model with each candidate block skipped), the same batch size. Verdicts must agree item by item.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from layerprune.core.settings import RunSettings  # noqa: E402
from layerprune.models import find_decoder_stack, load_model  # noqa: E402
from layerprune.prune.calib import gsm8k_calib  # noqa: E402
from layerprune.prune.scores import ScoreContext  # noqa: E402
from layerprune.prune.scores.ablation import generated_correct, generated_correct_per_candidate  # noqa: E402
from layerprune.tasks.data import resolve_data_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--items", type=int, default=8)
    parser.add_argument("--candidates", default="4,13,20,25", help="blocks skipped one at a time, comma-separated")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, RunSettings(device="cpu", dtype="float32"))
    calib = gsm8k_calib(args.items, 0, resolve_data_dir(None))
    ctx = ScoreContext(model=loaded.model, tokenizer=loaded.tokenizer, stack=find_decoder_stack(loaded.model),
                       batches=[], calib=calib, drop=1, protected=[], metric="accuracy", batch_size=args.batch_size,
                       max_new_tokens=args.max_new_tokens)
    skips = {-1: [], **{int(c): [int(c)] for c in args.candidates.split(",")}}
    start = time.perf_counter()
    each = {c: generated_correct(ctx, calib.items, skip) for c, skip in skips.items()}
    each_s = time.perf_counter() - start
    start = time.perf_counter()
    together = generated_correct_per_candidate(ctx, calib.items, skips)
    together_s = time.perf_counter() - start
    agree = sum(a == b for c in skips for a, b in zip(each[c], together[c], strict=False))
    total = len(skips) * len(calib.items)
    print(f"{args.model}: {len(calib.items)} GSM8K-train items x {len(skips)} models (full + skip one of "
          f"{args.candidates}), batch {args.batch_size}, up to {args.max_new_tokens} new tokens")
    for c in skips:
        print(f"{'full' if c == -1 else f'skip {c}':>10s} accuracy one call each {sum(each[c]) / len(calib.items):.3f}"
              f", together {sum(together[c]) / len(calib.items):.3f}")
    print(f"agreement: {agree}/{total} verdicts")
    print(f"time: one generate call per candidate {each_s:.1f} s, all candidates together {together_s:.1f} s, "
          f"speedup {each_s / together_s:.2f}x")


if __name__ == "__main__":
    main()
