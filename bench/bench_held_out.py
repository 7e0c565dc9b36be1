"""A recovery's held-out evaluations with the teacher's side computed at each one vs once a run, side by side.

    nice -n 10 python bench/bench_held_out.py [--model embedded] [--rows 24] [--evaluations 4] [--drop 2]

The teacher is frozen, so its log-probabilities over the held-out answers are the same at every evaluation of a run
(before training, every eval_steps, after). recover/heldout.HeldOutTeacher keeps them on the CPU. The same student
(the model minus `--drop` blocks) and the same rows (Dolly answers, chat format) are evaluated `--evaluations` times
each way; the numbers must be equal to the last bit, and the ratio of the times is printed. First, the rate of a
forward one sequence at a time (the dry run's "forward tokens/s").
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from layerprune.core.settings import RunSettings  # noqa: E402
from layerprune.models import drop_blocks, find_decoder_stack, load_model  # noqa: E402
from layerprune.recover import heldout  # noqa: E402
from layerprune.recover.schema import GenerationSection  # noqa: E402
from layerprune.tasks.data import resolve_data_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--evaluations", type=int, default=4)
    parser.add_argument("--drop", type=int, default=2, help="blocks dropped from the middle for the student")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, RunSettings(device="cpu", dtype="float32"))
    teacher = loaded.model.eval()
    student = copy.deepcopy(teacher)
    depth = len(find_decoder_stack(student))
    drop_blocks(student, list(range(depth // 2, depth // 2 + args.drop)))
    with open(resolve_data_dir(None) / "dolly" / "train.jsonl") as handle:
        rows = [json.loads(line) for _, line in zip(range(args.rows), handle, strict=False)]
    rows = [{"prompt": r["instruction"], "response": r["response"]} for r in rows]
    encoded = heldout.encode_rows(loaded.tokenizer, rows, GenerationSection(), 512)
    tokens = sum(len(ids) - start for ids, start in encoded)

    with torch.no_grad():  # the dry run's "forward tokens/s": one sequence at a time, no grad (cells.RATES)
        teacher(input_ids=torch.tensor([encoded[0][0]]), use_cache=False)  # warm
        start = time.perf_counter()
        for ids, _ in encoded:
            teacher(input_ids=torch.tensor([ids]), use_cache=False)
        rate = sum(len(ids) for ids, _ in encoded) / (time.perf_counter() - start)
    print(f"one sequence at a time, no grad: {rate:.0f} tokens/s over {len(encoded)} rows (prompt and answer)")
    start = time.perf_counter()
    plain = [heldout.held_out_metrics(student, teacher, encoded) for _ in range(args.evaluations)]
    each = time.perf_counter() - start
    side = heldout.HeldOutTeacher(teacher, encoded)
    start = time.perf_counter()
    kept = [heldout.held_out_metrics(student, side, encoded) for _ in range(args.evaluations)]
    once = time.perf_counter() - start
    assert kept == plain, "the kept teacher side changed the numbers"
    kept_mb = sum(t.numel() * t.element_size() for t in side.kept) / 2**20
    print(f"{len(encoded)} held-out rows, {tokens} completion tokens, student {depth - args.drop} of {depth} blocks, "
          f"{args.evaluations} evaluations; CE {plain[0]['ce']:.4f}, KL {plain[0]['kl']:.4f} (equal both ways)")
    print(f"teacher side at each evaluation: {each:.1f} s; computed once and kept ({kept_mb:.0f} MiB): {once:.1f} s; "
          f"ratio {once / each:.2f} (teacher forwards {args.evaluations * len(encoded)} vs {side.forwards})")


if __name__ == "__main__":
    main()
