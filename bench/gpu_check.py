"""The GPU check for an 8B user: one script, one JSON and a short Markdown summary, written as it goes.

    PYTHONPATH=src python3 bench/gpu_check.py --out $OUT/gpu_check.json                 # on the GPU machine (<9 min)
    PYTHONPATH=src .venv/bin/python bench/gpu_check.py --device cpu --tiny --out /tmp/gpu_check.json   # CI form

Random-initialised models from the real configs of Llama-3.1-8B and Qwen2.5-7B (bench/configs/, config files only;
no weights are downloaded; --tiny shrinks the sizes and keeps the rest) are written as bf16 safetensors in 5 GB
shards, then:
1. streaming prune of the last `--drop` blocks, verification on (block-major): time against `cp -r`, peak RSS;
2. one-shot NLL ablation with prefix reuse (sequences per second) against the naive loop on a few candidates;
3. teacher-forced accuracy ablation (sequences per second);
4. a few steps each of LoRA, full SFT and KD at `--max-length` on the pruned model: peak
   torch.cuda.max_memory_allocated against layerprune's memory plan (ratio), tokens per second;
5. free-form answers for several candidates in one batched generate call against one call per candidate.
Every step's result (or its error, or why it was skipped) lands in the JSON and the Markdown as soon as it exists,
so a timeout keeps what is done. Training loops are plain torch + peft (TRL is not on the GPU machine); full SFT
uses torch AdamW (bitsandbytes' 8-bit AdamW is not there either) and says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]
PARTS = ("stream", "ablation", "accuracy", "candidates", "train")  # --only's names; the build always runs
CONFIGS = {"llama31-8b": ROOT / "bench/configs/llama-3.1-8b.json", "qwen25-7b": ROOT / "bench/configs/qwen2.5-7b.json"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=384, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
PRUNE_CHILD = r"""
import json, sys, time
from pathlib import Path
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from layerprune.core.settings import RunSettings
source, out, device, drop = sys.argv[1], Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
start = time.perf_counter()
settings = RunSettings(device=device, max_shard_size="5GB")
report = prune_model(source, PruneRecipe(layers=drop), settings, output=out).report
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss": hwm, "verification": report["verification"],
                  "timings": report.get("timings")}))
"""


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Any, device: str) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    value = fn()
    sync(device)
    return time.perf_counter() - start, value


def build_model(name: str, directory: Path, device: str, tiny: bool) -> dict:
    """A random model of the real config (bf16, 5 GB shards) and the tiny test tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny import tiny_tokenizer

    config = AutoConfig.from_pretrained(CONFIGS[name])
    if tiny:  # the same family and settings at toy sizes (per-layer fields rebuilt for the new depth)
        fields = {k: v for k, v in config.to_dict().items() if k not in ("layer_types", "model_type")}
        config = AutoConfig.for_model(config.model_type, **{**fields, **TINY})
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="5GB")
    tiny_tokenizer().save_pretrained(directory)
    shards = sorted(directory.glob("*.safetensors"))
    params = model.num_parameters()
    del model
    free(device)
    return dict(params=params, shards=len(shards), largest_shard_bytes=max(s.stat().st_size for s in shards),
                total_bytes=sum(s.stat().st_size for s in shards), layers=config.num_hidden_layers,
                seconds=round(time.perf_counter() - start, 1))


def free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def stream_prune(source: Path, out: Path, device: str, drop: list[int]) -> dict:
    """The streamed prune in a fresh interpreter (peak RSS of its own), against `cp -r` of the same files."""
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(out) + "-cp"], check=True)
    cp = time.perf_counter() - start
    shutil.rmtree(str(out) + "-cp")
    done = subprocess.run([sys.executable, "-c", PRUNE_CHILD, str(source), str(out), device, json.dumps(drop)],
                          capture_output=True, text=True, check=True, env=_child_env())
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shards = list(source.glob("*.safetensors"))
    largest = max(s.stat().st_size for s in shards)
    block = _block_bytes(source)
    return dict(seconds=round(result["seconds"], 1), cp_seconds=round(cp, 1),
                ratio_to_cp=round(result["seconds"] / cp, 2),
                peak_rss_bytes=result["peak_rss"], largest_shard_bytes=largest, block_bytes=block,
                rss_over_shard_plus_block=round(result["peak_rss"] / (largest + block), 2),
                verification={k: v for k, v in result["verification"].items() if not isinstance(v, dict)},
                phase_seconds=result["verification"].get("phase_seconds"), timings=result.get("timings"))


def _child_env() -> dict:
    import os

    # the source first, then what the caller had on the path (packages installed with --target, as on the GPU machine)
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


def _block_bytes(source: Path) -> int:
    from layerprune.models.shards import read_checkpoint

    checkpoint = read_checkpoint(source)
    from safetensors import safe_open

    total = 0
    for name, file in checkpoint.weight_map.items():
        if ".layers.0." in name:
            with safe_open(source / file, "pt") as handle:
                sl = handle.get_slice(name)
                total += 2 * _numel(sl.get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load(path: Path, device: str) -> Any:
    from layerprune.core.settings import RunSettings
    from layerprune.models import load_model

    return load_model(str(path), RunSettings(device=device, dtype="bfloat16"))


def ablation_speed(model_dir: Path, device: str, samples: int, seq_len: int, batch: int, naive_candidates: int) -> dict:
    """Prefix-reuse one-shot ablation over every block vs the naive full forward per candidate (a few)."""
    from bench_prune import naive_loss

    from layerprune.models import find_decoder_stack
    from layerprune.prune.calib import load_calibration, tokenize_calibration
    from layerprune.prune.scores import ScoreContext, run_importance_score

    loaded = load(model_dir, device)
    stack = find_decoder_stack(loaded.model)
    calib = load_calibration("arithmetic", samples, 0, None)
    batches = [b.to(loaded.model.device) for b in tokenize_calibration(calib, loaded.tokenizer, seq_len, batch)]
    ctx = ScoreContext(model=loaded.model, tokenizer=loaded.tokenizer, stack=stack, batches=batches, calib=calib,
                       drop=1, protected=[])
    run_importance_score("ablation", ScoreContext(**{**vars(ctx), "batches": batches[:1]}))  # warm-up
    fast_s, result = timed(lambda: run_importance_score("ablation", ctx), device)
    picked = list(range(0, len(stack), max(1, len(stack) // naive_candidates)))[:naive_candidates]
    naive_s, naive = timed(lambda: [naive_loss(loaded.model, stack, batches, [c]) for c in picked], device)
    diff = max(abs(naive[n] - (result.scores[c] + result.details["base"])) for n, c in enumerate(picked))
    per_candidate_fast, per_candidate_naive = fast_s / len(stack), naive_s / len(picked)
    sequences = samples * len(stack)
    return dict(blocks=len(stack), sequences=samples, tokens=int(sum(b.input_ids.numel() for b in batches)),
                fast_s=round(fast_s, 2), sequences_per_s=round(sequences / fast_s, 1),
                naive_candidates=picked, naive_s=round(naive_s, 2),
                speedup_per_candidate=round(per_candidate_naive / per_candidate_fast, 2),
                max_abs_loss_diff=diff)


def teacher_forced_speed(model_dir: Path, device: str, samples: int, batch: int) -> dict:
    """Accuracy ablation on short answers: teacher-forced, one pass per candidate from its prefix."""
    from layerprune.models import find_decoder_stack
    from layerprune.prune.calib import load_calibration
    from layerprune.prune.scores import ScoreContext, run_importance_score

    loaded = load(model_dir, device)
    stack = find_decoder_stack(loaded.model)
    calib = load_calibration("arithmetic", samples, 0, None)
    ctx = ScoreContext(model=loaded.model, tokenizer=loaded.tokenizer, stack=stack, batches=[], calib=calib, drop=1,
                       protected=[], metric="accuracy", batch_size=batch, max_new_tokens=8)
    seconds, result = timed(lambda: run_importance_score("ablation", ctx), device)
    return dict(blocks=len(stack), sequences=samples, seconds=round(seconds, 2),
                sequences_per_s=round(samples * (len(stack) + 1) / seconds, 1), drop=result.drop)


def candidates_speed(model_dir: Path, device: str, items: int, candidates: int, max_new_tokens: int) -> dict:
    """Free-form answers for the full model and `candidates` skipped blocks: one generate call vs one call each."""
    from layerprune.models import find_decoder_stack
    from layerprune.prune.calib import arithmetic_calib, gsm8k_calib
    from layerprune.prune.scores import ScoreContext
    from layerprune.prune.scores.ablation import generated_correct, generated_correct_per_candidate
    from layerprune.tasks.data import resolve_data_dir

    try:
        calib, source = gsm8k_calib(items, 0, resolve_data_dir(None)), "gsm8k train"
    except Exception as exc:  # noqa: BLE001  the GPU machine has no data mirror
        calib, source = arithmetic_calib(items, 0, None), f"arithmetic prompts (gsm8k unavailable: {str(exc)[:80]})"
    loaded = load(model_dir, device)
    stack = find_decoder_stack(loaded.model)
    ctx = ScoreContext(model=loaded.model, tokenizer=loaded.tokenizer, stack=stack, batches=[], calib=calib, drop=1,
                       protected=[], metric="accuracy", batch_size=64, max_new_tokens=max_new_tokens)
    step = max(1, len(stack) // candidates)
    skips = {-1: [], **{c: [c] for c in range(1, len(stack), step)[:candidates]}}
    each_s, each = timed(lambda: {c: generated_correct(ctx, calib.items, s) for c, s in skips.items()}, device)
    together_s, together = timed(lambda: generated_correct_per_candidate(ctx, calib.items, skips), device)
    agree = sum(a == b for c in skips for a, b in zip(each[c], together[c], strict=False))
    return dict(items=len(calib.items), source=source, models=len(skips), max_new_tokens=max_new_tokens,
                one_call_each_s=round(each_s, 2), batched_s=round(together_s, 2),
                speedup=round(each_s / together_s, 2), agreement=f"{agree}/{len(skips) * len(calib.items)}")


def train_steps(method: str, student: Path, teacher: Path, device: str, seq_len: int, steps: int, r: int) -> dict:
    """`steps` optimizer steps of `method` (lora, full, kd) at batch 1 x `seq_len`, gradient checkpointing on:
    the peak allocated memory against layerprune's plan for the same run, and tokens per second."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from layerprune.recover import memory

    cuda = device.startswith("cuda")
    shape = memory.model_shape(AutoConfig.from_pretrained(student))
    teacher_shape = memory.model_shape(AutoConfig.from_pretrained(teacher)) if method == "kd" else None
    plan = memory.plan_memory(shape, method, seq_len=seq_len, batch_size=1, weight_bytes=2,
                              lora_r=r if method != "full" else 0, gradient_checkpointing=True, teacher=teacher_shape,
                              cuda=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.bfloat16).to(device)
    model.gradient_checkpointing_enable()
    if method in ("lora", "kd"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=r, target_modules="all-linear"))
        model.enable_input_require_grads()
    teacher_model = (AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.bfloat16).to(device).eval()
                     if method == "kd" else None)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(3, model.config.vocab_size if method != "full" else 300, (1, seq_len), device=device)

    def one_step() -> float:
        if teacher_model is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            student_lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
            with torch.no_grad():
                target = torch.log_softmax(teacher_model(input_ids=ids).logits.float(), -1)
            loss = (target.exp() * (target - student_lp)).sum(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    one_step()  # warm-up: kernels, optimizer states
    seconds, losses = timed(lambda: [one_step() for _ in range(steps)], device)
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
    return dict(method=method, optimizer="adamw_torch (torch.optim.AdamW; 8-bit AdamW unavailable)",
                seq_len=seq_len, steps=steps, lora_r=r if method != "full" else None,
                tokens_per_s=round(steps * seq_len / seconds, 1), finite=all(v == v for v in losses),
                plan_gb=round(plan.total, 2), peak_gb=round(peak / 1e9, 2) if peak is not None else None,
                plan_over_peak=round(plan.total * 1e9 / peak, 3) if peak else None,
                plan=dict(weights=round(plan.weights, 2), adapters=round(plan.adapters, 3),
                          gradients=round(plan.gradients, 2), optimizer_states=round(plan.optimizer_states, 2),
                          activations=round(plan.activations, 2), teacher=round(plan.teacher, 2),
                          optimizer_step=round(plan.optimizer_step, 2)))


def environment(device: str) -> dict:
    import torch
    import transformers

    env = dict(python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__,
               cuda=torch.cuda.is_available(), device=device)
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for name in ("peft", "accelerate", "safetensors", "trl", "bitsandbytes", "datasets", "lm_eval"):
        try:  # the installed version, without importing the package
            env[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            env[name] = "not installed"
    return env


class Recorder:
    """Results of every step, rewritten to the JSON and the Markdown after each one; a deadline skips the rest."""

    def __init__(self, out: Path | None, budget_s: float, device: str) -> None:
        self.out, self.results, self.start, self.budget_s = out, {}, time.perf_counter(), budget_s
        self.device = device

    def step(self, name: str, fn: Any) -> Any:
        print(f"\n===== {name}", flush=True)
        elapsed = time.perf_counter() - self.start
        if elapsed > self.budget_s:
            self.results[name] = dict(skipped=f"time budget: {elapsed:.0f} s of {self.budget_s:.0f} s used")
        else:
            start = time.perf_counter()
            try:
                self.results[name] = fn()
            except Exception as exc:  # noqa: BLE001  a failed step is recorded, the next ones still run
                self.results[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:500]}",
                                          traceback=traceback.format_exc()[-2000:])
            free(self.device)  # the step's models are gone with its frame
            self.results[name]["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(self.results[name], indent=1, default=str)[:3000], flush=True)
        self.write()
        return self.results[name]

    def skip(self, name: str, why: str) -> None:
        self.results[name] = dict(skipped=why)
        self.write()

    def write(self) -> None:
        if self.out is None:
            return
        self.out.write_text(json.dumps(self.results, indent=2, default=str))
        self.out.with_suffix(".md").write_text(summary(self.results))


def summary(results: dict) -> str:
    """One line per step: its headline figures, or its error, or why it was skipped."""
    lines = ["# GPU check", "", f"environment: {json.dumps(results.get('environment', {}), default=str)}", ""]
    for name, r in results.items():
        if name in ("environment", "args"):
            continue
        if "error" in r or "skipped" in r:
            lines.append(f"- **{name}**: {r.get('error') or 'skipped: ' + r['skipped']}")
            continue
        keys = [k for k in ("seconds", "cp_seconds", "ratio_to_cp", "rss_over_shard_plus_block", "sequences_per_s",
                            "speedup_per_candidate", "max_abs_loss_diff", "tokens_per_s", "peak_gb", "plan_gb",
                            "plan_over_peak", "speedup", "agreement", "params", "shards") if k in r]
        figures = ", ".join(f"{k} {r[k]}" for k in keys)
        if "verification" in r:
            v = r["verification"]
            figures += f", verification {v.get('logits_check')} max |diff| {v.get('max_abs_diff')}"
        lines.append(f"- **{name}**: {figures}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="shrunken configs (the CPU form run in CI)")
    parser.add_argument("--models", default="llama31-8b,qwen25-7b", help=f"comma-separated, of {sorted(CONFIGS)}")
    parser.add_argument("--drop", type=int, default=8, help="blocks streamed out (the last ones)")
    parser.add_argument("--samples", type=int, default=32, help="calibration sequences of the ablation steps")
    parser.add_argument("--seq-len", type=int, default=256, help="calibration sequence length")
    parser.add_argument("--max-length", type=int, default=2048, help="training sequence length")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per training method")
    parser.add_argument("--budget-s", type=float, default=500, help="steps not started by then are skipped")
    parser.add_argument("--work", type=Path, default=None, help="where the models are written (default: a temp dir)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (the build always runs)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.drop, args.samples, args.max_length, args.steps = 2, 4, 64, 1
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    rec = Recorder(args.out, args.budget_s, args.device)
    rec.results["args"] = {k: str(v) for k, v in vars(args).items()}
    rec.step("environment", lambda: environment(args.device))
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for number, name in enumerate(args.models.split(",")):
            run_model(rec, args, name, Path(tmp) / name, first=number == 0)
    return rec.results


def run_model(rec: Recorder, args: argparse.Namespace, name: str, root: Path, first: bool) -> None:
    """Build, stream-prune and (the first model) score and train, the parts `--only` names; the files are removed
    after."""
    root.mkdir(parents=True)
    source, pruned = root / "model", root / "pruned"
    only, device = set(args.only.split(",")), args.device
    built = rec.step(f"{name}: build", lambda: build_model(name, source, device, args.tiny))
    if "layers" not in built:
        return
    drop = list(range(built["layers"] - args.drop - 1, built["layers"] - 1))  # the last blocks but the final one
    if only & {"stream", "train"}:  # training runs on the pruned model
        rec.step(f"{name}: streaming prune", lambda: stream_prune(source, pruned, device, drop))
    steps = {
        "ablation": (f"{name}: ablation (prefix reuse)", lambda: ablation_speed(
            source, device, args.samples, args.seq_len, 8, 3 if args.tiny else 4)),
        "accuracy": (f"{name}: teacher-forced accuracy",
                     lambda: teacher_forced_speed(source, device, args.samples, 16)),
        "candidates": (f"{name}: candidates batched", lambda: candidates_speed(
            source, device, 4 if args.tiny else 16, 3, 16 if args.tiny else 64)),
    }
    for part, (label, fn) in steps.items():
        if first and part in only:
            rec.step(label, fn)
    if first and "train" in only and pruned.is_dir():
        for method in ("lora", "full", "kd"):
            rec.step(f"{name}: train {method}", lambda m=method: train_steps(
                m, pruned, source, device, args.max_length, args.steps, 16))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
