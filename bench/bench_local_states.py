"""The local step's teacher states captured by a run vs read from the file an earlier run of the study kept.

    nice -n 10 python bench/bench_local_states.py [--model embedded] [--sequences 32] [--drop 13,18]

A budget study runs local once per budget on one cut and seed (limits-budget-math-embedded: 4 runs of 922 Dolly
sequences each, spans at blocks 13 and 18), every run capturing the same teacher states. recover/local.span_states
keeps them in the study's folder: the first run captures and writes them, the others read them. Both ways are timed
on the same sequences (Dolly answers, chat format, up to 512 tokens), and the states read must equal those captured.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from layerprune.core.settings import RunSettings  # noqa: E402
from layerprune.models import load_model  # noqa: E402
from layerprune.recover import heldout, local  # noqa: E402
from layerprune.recover.schema import GenerationSection  # noqa: E402
from layerprune.tasks.data import resolve_data_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--drop", default="13,18", help="dropped blocks (the budget study's cut at k = 2)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, RunSettings(device="cpu", dtype="float32"))
    teacher = loaded.model.eval()
    with open(resolve_data_dir(None) / "dolly" / "train.jsonl") as handle:
        rows = [json.loads(line) for _, line in zip(range(args.sequences), handle, strict=False)]
    rows = [{"prompt": r["instruction"], "response": r["response"]} for r in rows]
    sequences = [ids for ids, _ in heldout.encode_rows(loaded.tokenizer, rows, GenerationSection(), 512)]
    dropped = [int(b) for b in args.drop.split(",")]
    spans = local.local_spans(dropped, len(local.decoder_layers(teacher)), "before")
    with tempfile.TemporaryDirectory() as folder:
        states = Path(folder)
        start = time.perf_counter()
        digest = local.teacher_digest(teacher)
        hashed = time.perf_counter() - start
        start = time.perf_counter()
        captured = [local.span_states(teacher, span, sequences, states, digest) for span in spans]
        first = time.perf_counter() - start
        size = sum(p.stat().st_size for p in states.glob("*.pt")) / 2**20
        start = time.perf_counter()
        read = [local.span_states(teacher, span, sequences, states, local.teacher_digest(teacher)) for span in spans]
        again = time.perf_counter() - start
    equal = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for x, y in zip(captured, read, strict=True)
                for a, b in zip(x, y, strict=True))
    assert equal, "the states read differ from those captured"
    tokens = sum(map(len, sequences))
    print(f"{len(sequences)} sequences ({tokens} tokens), spans at blocks {[s.trained for s in spans]}; "
          f"teacher digest {hashed:.2f} s")
    print(f"captured and kept: {first:.1f} s ({size:.0f} MiB written); read back (digest included): {again:.1f} s; "
          f"ratio {again / first:.3f}; equal: {equal}")


if __name__ == "__main__":
    main()
