"""Teacher-forced greedy exact match vs generating the answers: per-item agreement and speed, side by side.

    nice -n 10 python bench/bench_teacher_forced.py [--model embedded] [--items 200] [--candidates 10]

The same arithmetic probe items, the same candidates (the full model and the model with each candidate block
skipped), the same batch size; generation stops at the items' stop string. Target (issue 14): >= 99% agreement.
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
from layerprune.prune.calib import CalibItem, CalibSet  # noqa: E402
from layerprune.prune.scores import ScoreContext  # noqa: E402
from layerprune.prune.scores.ablation import generated_correct, teacher_forced_correct  # noqa: E402
from layerprune.tasks.probes import arithmetic_probes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--candidates", default="4,20", help="blocks skipped one at a time, comma-separated")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, RunSettings(device="cpu", dtype="float32"))
    stack = find_decoder_stack(loaded.model)
    depth = len(stack)
    candidates = sorted(int(c) for c in args.candidates.split(","))
    half = args.items // 2  # one- and two-digit sums: a small model gets many right, so agreement is not trivial
    probes = arithmetic_probes(half, kind="digits", digits=1) + arithmetic_probes(
        args.items - half, kind="digits", digits=2
    )
    calib = CalibSet([CalibItem(p.prompt, p.answer, p.answer.strip()) for p in probes], "arithmetic sums")
    ctx = ScoreContext(
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        stack=stack,
        batches=[],
        calib=calib,
        drop=1,
        protected=[],
        metric="accuracy",
        batch_size=args.batch_size,
        max_new_tokens=8,
    )
    items = calib.items
    start = time.perf_counter()
    forced = teacher_forced_correct(ctx, items, list(range(depth)), candidates)
    forced_s = time.perf_counter() - start
    start = time.perf_counter()
    generated = {c: generated_correct(ctx, items, [] if c == -1 else [c]) for c in [-1, *candidates]}
    generated_s = time.perf_counter() - start
    agree = sum(a == b for c in generated for a, b in zip(forced[c], generated[c], strict=False))
    total = sum(len(v) for v in generated.values())
    print(
        f"{args.model}: {len(items)} arithmetic items (1- and 2-digit sums, 3-shot) x {len(generated)} models "
        f"(full + skip one of {candidates})"
    )
    print(f"{'model':>10s} {'teacher-forced acc':>18s} {'generated acc':>13s} {'disagreements':>13s}")
    for c in generated:
        diff = sum(a != b for a, b in zip(forced[c], generated[c], strict=False))
        print(
            f"{'full' if c == -1 else f'skip {c}':>10s} {sum(forced[c]) / len(items):18.3f} "
            f"{sum(generated[c]) / len(items):13.3f} {diff:13d}"
        )
    print(f"agreement: {agree}/{total} verdicts = {agree / total:.2%}")
    print(
        f"time: teacher-forced {forced_s:.1f} s, generation {generated_s:.1f} s, speedup {generated_s / forced_s:.1f}x"
    )


if __name__ == "__main__":
    main()
