"""GPU-only checks, run as one script on a CUDA machine (CPU smoke run: --device cpu --tiny).

    PYTHONPATH=src python3 bench/gpu_check.py --out $OUT/gpu_check.json            # on the GPU machine
    PYTHONPATH=src .venv/bin/python bench/gpu_check.py --device cpu --tiny --out /tmp/gpu_check.json

1. prune_model on a random SmolLM2-135M-shaped Llama (vocab of the tiny test tokenizer), bf16: saves, reloads,
   and the prefix-reuse ablation (one-shot and iterative) timed against the naive full-forward loops.
2. bitsandbytes + QLoRA: the project's gpu-marked tests (tests/test_recover.py -m gpu), in a subprocess.
3. bench/bench_recover.py --device cuda (memory estimate vs measured peak), in a subprocess.
Each step's results are written to the JSON as soon as they exist, so a timeout keeps the earlier ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

SMOLLM2_LIKE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=10, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(directory: Path, tiny: bool) -> Path:
    """A random Llama with the SmolLM2-135M shape (default init) and the tiny test tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tiny import CHAT_TEMPLATE, tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(**(TINY if tiny else SMOLLM2_LIKE), vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def check_prune(model_dir: Path, out_dir: Path, device: str, samples: int, drop: int) -> dict:
    """prune_model end to end on `device` in bf16, then a reload of the output and a forward pass on it."""
    import torch
    from transformers import AutoModelForCausalLM

    from layerprune.prune.api import prune_model
    from layerprune.prune.recipe import PruneRecipe
    from layerprune.prune.report import read_prune_report
    from layerprune.settings import RunSettings

    start = time.perf_counter()
    result = prune_model(str(model_dir), PruneRecipe(drop=drop, calib="arithmetic", calib_samples=samples),
                         RunSettings(device=device, dtype="bfloat16"), output=out_dir)
    seconds = time.perf_counter() - start
    report = read_prune_report(out_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16).to(device).eval()
    ids = torch.randint(0, reloaded.config.vocab_size, (2, 32), device=device)
    with torch.inference_mode():
        loss = float(reloaded(input_ids=ids, labels=ids).loss)
    files = sorted(p.name for p in out_dir.iterdir())
    return dict(ok=bool(report.num_blocks_after == report.num_blocks_before - drop
                        and reloaded.config.num_hidden_layers == report.num_blocks_after and loss == loss),
                prune_seconds=round(seconds, 2), timings=report.timings, dropped=report.dropped,
                num_blocks=[report.num_blocks_before, report.num_blocks_after],
                reload_dtype=str(next(reloaded.parameters()).dtype), reload_loss=round(loss, 4),
                weights_dtype_in_model=str(result.loaded.model.dtype), files=files)


def timed(fn, device: str) -> tuple[float, object]:  # noqa: ANN001
    sync(device)
    start = time.perf_counter()
    value = fn()
    sync(device)
    return time.perf_counter() - start, value


def time_ablation(model_dir: Path, device: str, samples: int, drop: int, seq_len: int, batch_size: int) -> dict:
    """Prefix-reuse ablation (run_importance_score) vs bench_prune.naive_loss loops, same batches, on `device`, bf16."""
    import torch
    from bench_prune import naive_loss

    from layerprune.models import find_decoder_stack, load_model
    from layerprune.prune.calib import load_calibration, tokenize_calibration
    from layerprune.prune.scores import ScoreContext, run_importance_score
    from layerprune.settings import RunSettings

    loaded = load_model(str(model_dir), RunSettings(device=device, dtype="bfloat16"))
    model, stack = loaded.model.eval(), find_decoder_stack(loaded.model)
    calib = load_calibration("arithmetic", samples, 0, None)
    batches = [b.to(model.device) for b in tokenize_calibration(calib, loaded.tokenizer, seq_len, batch_size)]
    depth = len(stack)

    def ctx(iterative: bool) -> ScoreContext:
        return ScoreContext(
            model=model,
            tokenizer=loaded.tokenizer,
            stack=stack,
            batches=batches,
            calib=calib,
            drop=drop,
            protected=[0],
            iterative=iterative,
        )

    def naive_iterative() -> list[int]:
        dropped: list[int] = []
        for _ in range(drop):
            losses = {
                c: naive_loss(model, stack, batches, sorted([*dropped, c])) for c in range(1, depth) if c not in dropped
            }
            dropped.append(min(losses, key=lambda c: (losses[c], -c)))
        return sorted(dropped)

    with torch.inference_mode():  # warm-up (kernel selection, allocator)
        naive_loss(model, stack, batches, [])
        run_importance_score("ablation", ctx(False))
    t_naive1, naive1 = timed(lambda: [naive_loss(model, stack, batches, [c]) for c in range(depth)], device)
    t_fast1, res = timed(lambda: run_importance_score("ablation", ctx(False)), device)
    fast1 = [None if s is None else s + res.details["base"] for s in res.scores]
    diffs = [abs(a - b) for a, b in zip(naive1, fast1, strict=False) if b is not None]
    t_naive_it, naive_drop = timed(naive_iterative, device)
    t_fast_it, fast_res = timed(lambda: run_importance_score("ablation", ctx(True)), device)
    return dict(
        depth=depth,
        batches=len(batches),
        tokens=int(sum(b.input_ids.numel() for b in batches)),
        oneshot=dict(
            naive_s=round(t_naive1, 3),
            fast_s=round(t_fast1, 3),
            ratio=round(t_fast1 / t_naive1, 3),
            max_abs_loss_diff=max(diffs),
            fast_drop=sorted(res.drop),
        ),
        iterative=dict(
            naive_s=round(t_naive_it, 3),
            fast_s=round(t_fast_it, 3),
            ratio=round(t_fast_it / t_naive_it, 3),
            naive_drop=naive_drop,
            fast_drop=sorted(fast_res.drop),
            same=naive_drop == sorted(fast_res.drop),
        ),
    )


def run_sub(cmd: list[str], timeout: int) -> dict:
    """A subprocess with a timeout; return code, seconds and the tail of its output."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = (
            "timeout",
            (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace"),
        )
    print(text[-4000:], flush=True)
    return dict(cmd=" ".join(cmd), returncode=code, seconds=round(time.perf_counter() - start, 1), tail=text[-3000:])


def check_bnb() -> dict:
    """bitsandbytes import and a 4-bit linear layer forward on CUDA."""
    import bitsandbytes as bnb
    import torch

    layer = bnb.nn.Linear4bit(256, 256, compute_dtype=torch.bfloat16, quant_type="nf4").cuda()
    y = layer(torch.randn(4, 256, device="cuda", dtype=torch.bfloat16))
    return dict(version=bnb.__version__, linear4bit_out=list(y.shape), finite=bool(torch.isfinite(y).all()))


def step(name: str, results: dict, out: Path | None, fn) -> None:  # noqa: ANN001
    print(f"\n===== {name}", flush=True)
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # noqa: BLE001  a failed step is reported, the next ones still run
        results[name] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    results[name + "_wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(results[name], indent=1, default=str)[:6000], flush=True)
    if out is not None:
        out.write_text(json.dumps(results, indent=2, default=str))


def environment(device: str) -> dict:
    import torch
    import transformers

    env = dict(
        python=sys.version.split()[0],
        torch=torch.__version__,
        transformers=transformers.__version__,
        cuda=torch.cuda.is_available(),
    )
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for name in ("pydantic", "peft", "trl", "datasets", "bitsandbytes", "accelerate"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001
            env[name] = f"unavailable: {type(exc).__name__}: {exc}"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small config (CPU smoke run)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--drop", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: prune,ablation,qlora,recover_memory")
    parser.add_argument("--sub-timeout", type=int, default=150)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    step("environment", results, args.out, lambda: environment(args.device))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.tiny)
        if "prune" not in skip:
            step(
                "prune",
                results,
                args.out,
                lambda: check_prune(model_dir, Path(tmp) / "pruned", args.device, args.samples, args.drop),
            )
        if "ablation" not in skip:
            step(
                "ablation_timing",
                results,
                args.out,
                lambda: time_ablation(model_dir, args.device, args.samples, args.drop, args.seq_len, args.batch_size),
            )
    if "qlora" not in skip:
        if args.device.startswith("cuda"):
            step("bitsandbytes", results, args.out, check_bnb)
        step(
            "qlora_gpu_tests",
            results,
            args.out,
            lambda: run_sub(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-x",
                    "-m",
                    "gpu",
                    "-p",
                    "no:cacheprovider",
                    "tests/test_recover.py",
                ],
                args.sub_timeout,
            ),
        )
    if "recover_memory" not in skip:
        step(
            "recover_memory",
            results,
            args.out,
            lambda: run_sub(
                [
                    sys.executable,
                    "bench/bench_recover.py",
                    "--device",
                    "cuda" if args.device.startswith("cuda") else "cpu",
                ],
                args.sub_timeout,
            ),
        )
    summarize(results)


def summarize(results: dict) -> None:
    print("\n===== summary", flush=True)
    prune, abl = results.get("prune", {}), results.get("ablation_timing", {})
    if "ok" in prune:
        print(
            f"prune_model bf16: ok={prune['ok']} blocks {prune['num_blocks']} in {prune['prune_seconds']} s "
            f"(timings {prune['timings']}), dropped {prune['dropped']}, reload loss {prune['reload_loss']}"
        )
    if "oneshot" in abl:
        for kind in ("oneshot", "iterative"):
            r = abl[kind]
            print(
                f"ablation {kind:9s}: fast {r['fast_s']:.3f} s vs naive {r['naive_s']:.3f} s -> ratio {r['ratio']:.3f}"
            )
        print(
            f"one-shot max |naive - fast| loss {abl['oneshot']['max_abs_loss_diff']:.2e}; iterative same drops: "
            f"{abl['iterative']['same']}"
        )
    for name in ("bitsandbytes", "qlora_gpu_tests", "recover_memory"):
        if name in results:
            r = results[name]
            print(
                f"{name}: "
                + (
                    r["error"]
                    if "error" in r
                    else f"returncode {r.get('returncode', 'ok')} ({r.get('seconds', '')} s)"
                    if "returncode" in r
                    else json.dumps(r)
                )
            )


if __name__ == "__main__":
    main()
