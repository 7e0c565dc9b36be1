"""Prune-stage benchmark: ratios of layerprune's scoring to the naive loops, measured side by side.

    .venv/bin/python bench/bench_prune.py                 # SmolLM2-135M (embedded), 30 blocks
    .venv/bin/python bench/bench_prune.py --samples 8     # quicker

Each arm runs in its own subprocess (same model, same calibration batches) so that its peak memory
(VmHWM, minus the process's size right after loading) can be reported; times exclude loading.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = ["forward", "influence", "angular", "naive_oneshot", "fast_oneshot", "fast_oneshot_stacked", "naive_iterative",
        "fast_iterative", "reload_iterative_step1"]


def rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def setup(args):  # noqa: ANN001, ANN201
    import torch

    from layerprune.models import find_decoder_stack, load_model
    from layerprune.prune.calib import load_calibration, tokenize_calibration
    from layerprune.tasks.data import resolve_data_dir

    torch.manual_seed(0)
    loaded = load_model(args.model)
    calib = load_calibration(args.calib, args.samples, 0, resolve_data_dir(None))
    batches = tokenize_calibration(calib, loaded.tokenizer, args.seq_len, args.batch_size)
    return loaded, find_decoder_stack(loaded.model), calib, batches


def naive_loss(model, stack, batches, skip):  # noqa: ANN001, ANN201
    """A full forward pass of the model with `skip` removed, same masked NLL."""
    import torch
    import torch.nn.functional as F

    from layerprune.models import skipped_blocks

    total, count = 0.0, 0
    with torch.inference_mode(), skipped_blocks(model, skip):
        for b in batches:
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).logits
            mask = b.loss_mask[:, 1:].bool()
            total += float(F.cross_entropy(logits[:, :-1][mask].float(), b.input_ids[:, 1:][mask], reduction="sum"))
            count += int(mask.sum())
    return total / count


def reload_loss(loaded, batches, skip, workdir):  # noqa: ANN001, ANN201
    """What a reference implementation does: save the pruned model, load it back, evaluate it."""
    import copy

    from transformers import AutoModelForCausalLM

    from layerprune.models import drop_blocks, find_decoder_stack

    pruned = copy.deepcopy(loaded.model)
    drop_blocks(pruned, skip)
    path = Path(workdir) / "candidate"
    pruned.save_pretrained(path)
    del pruned
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    loss = naive_loss(model, find_decoder_stack(model), batches, [])
    shutil.rmtree(path)
    return loss


def context(loaded, stack, calib, batches, drop, iterative, stacked=1):  # noqa: ANN001, ANN201
    from layerprune.prune.scores import ScoreContext

    return ScoreContext(model=loaded.model, tokenizer=loaded.tokenizer, stack=stack, batches=batches, calib=calib,
                        drop=drop, protected=[0], iterative=iterative, params={"stack_candidates": stacked})


def run_arm(arm: str, args) -> dict:  # noqa: ANN001
    import torch

    loaded, stack, calib, batches = setup(args)
    depth, base_rss = len(stack), rss_mb()
    with torch.inference_mode():  # warm-up: first calls pay one-off kernel setup
        loaded.model(input_ids=batches[0].input_ids[:1, :32])
    repeats = args.repeats if arm in ("forward", "influence", "angular") else 1
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = _run_once(arm, args, loaded, stack, calib, batches, depth)
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    return {
        "arm": arm,
        "seconds": seconds,
        "peak_rss_mb": rss_mb(),
        "arm_rss_mb": rss_mb() - base_rss,
        "result": result,
    }


def _run_once(arm, args, loaded, stack, calib, batches, depth):  # noqa: ANN001, ANN202, C901
    import torch

    from layerprune.prune.scores import run_importance_score

    result: object = None
    if arm == "forward":
        with torch.inference_mode():
            for b in batches:
                loaded.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)
    elif arm in ("influence", "angular"):
        result = run_importance_score(
            "block-influence" if arm == "influence" else "angular",
            context(loaded, stack, calib, batches, args.drop, False),
        ).drop
    elif arm == "naive_oneshot":
        result = [naive_loss(loaded.model, stack, batches, [c]) for c in range(depth)]
    elif arm in ("fast_oneshot", "fast_oneshot_stacked"):
        stacked = 0 if arm == "fast_oneshot_stacked" else 1  # 0: every candidate in one stacked batch
        res = run_importance_score("ablation", context(loaded, stack, calib, batches, args.drop, False, stacked))
        result = [s + res.details["base"] for s in res.scores]
    elif arm == "naive_iterative":
        dropped: list[int] = []
        for _ in range(args.drop):
            losses = {
                c: naive_loss(loaded.model, stack, batches, sorted([*dropped, c]))
                for c in range(1, depth)
                if c not in dropped
            }
            dropped.append(min(losses, key=lambda c: (losses[c], -c)))
        result = sorted(dropped)
    elif arm == "fast_iterative":
        result = run_importance_score("ablation", context(loaded, stack, calib, batches, args.drop, True)).drop
    elif arm == "reload_iterative_step1":
        with tempfile.TemporaryDirectory() as workdir:
            result = [reload_loss(loaded, batches, [c], workdir) for c in range(1, depth)]
    return result


def spawn(arm: str, args) -> dict:  # noqa: ANN001
    cmd = [
        sys.executable,
        __file__,
        "--arm",
        arm,
        "--samples",
        str(args.samples),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--drop",
        str(args.drop),
        "--calib",
        args.calib,
        "--repeats",
        str(args.repeats),
    ]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratio_rows(r: dict, drop: int) -> list[tuple[str, float, str]]:
    """The ratios whose arms were all run."""
    rows = []

    def add(name: str, num: str, den: str, note: str, scale: float = 1.0) -> None:
        if num in r and den in r:
            rows.append((name, r[num]["seconds"] / (r[den]["seconds"] * scale), note))

    add("ablation one-shot vs naive loop", "fast_oneshot", "naive_oneshot", "target <= 0.60")
    add("ablation one-shot, --stack-candidates 0 (all), vs naive", "fast_oneshot_stacked", "naive_oneshot", "option")
    add("iterative ablation vs naive in-memory loop", "fast_iterative", "naive_iterative", "target <= 0.55")
    if "reload_iterative_step1" in r:
        depth = len(r["reload_iterative_step1"]["result"]) + 1
        scale = sum(depth - 1 - k for k in range(drop)) / (depth - 1)
        add(
            "iterative ablation vs save+reload per candidate*",
            "fast_iterative",
            "reload_iterative_step1",
            "reference implementation",
            scale,
        )
    add("block-influence vs one forward pass", "influence", "forward", "target <= 1.20")
    add("angular vs one forward pass", "angular", "forward", "target <= 1.20")
    return rows


def report(r: dict, drop: int) -> None:
    print(f"\n{'measurement':52s} {'ratio':>7s}  note")
    for name, ratio, note in ratio_rows(r, drop):
        print(f"{name:52s} {ratio:7.3f}  {note}")
    print("\narm seconds and peak memory (RSS MB: process peak / growth during the arm):")
    for arm, res in r.items():
        print(f"  {arm:24s} {res['seconds']:8.1f} s  {res['peak_rss_mb']:7.0f} / {res['arm_rss_mb']:6.0f}")
    if "naive_oneshot" in r and "fast_oneshot" in r:
        diff = max(abs(a - b) for a, b in zip(r["naive_oneshot"]["result"], r["fast_oneshot"]["result"], strict=False))
        print(f"\nmax |naive - fast| one-shot loss: {diff:.2e}")
    if "naive_oneshot" in r and "fast_oneshot_stacked" in r:
        diff = max(
            abs(a - b) for a, b in zip(r["naive_oneshot"]["result"], r["fast_oneshot_stacked"]["result"], strict=False)
        )
        print(f"max |naive - fast, all candidates stacked| one-shot loss: {diff:.2e}")
    if "naive_iterative" in r and "fast_iterative" in r:
        print(f"iterative drops: naive {r['naive_iterative']['result']}, fast {r['fast_iterative']['result']}")
    if "reload_iterative_step1" in r:
        print("* save+reload: step 1 measured in full, later steps scaled by their candidate counts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--calib", default="auto")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--drop", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs for the single-pass arms")
    parser.add_argument("--arm", choices=ARMS)
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args)))
        return
    results = {}
    for arm in args.arms.split(","):
        results[arm] = spawn(arm, args)
        print(f"{arm}: {results[arm]['seconds']:.1f} s", flush=True)
    report(results, args.drop)


if __name__ == "__main__":
    main()
