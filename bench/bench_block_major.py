"""Block-major vs in-memory scoring on a real model: the same scores, and peak memory against a third of the model.

    nice -n 10 python bench/bench_block_major.py [--model embedded] [--score ablation] [--samples 8]
    nice -n 10 python bench/bench_block_major.py --deep 32     # a random 32-block Llama, SmolLM2's tokenizer

The embedded model is shallow and wide-vocabulary (its tied 49k embedding is a fifth of it), so a third of it is
out of reach for any block-major scorer; `--deep N` builds a random float32 Llama with N blocks of width 1024 in a
temporary directory (SmolLM2-135M's tokenizer, ~1.8 GB for N=32) to show the peak on a model shaped like the ones
block-major is for (7B-70B: embeddings a few percent of the weights).

Each scorer runs `prune --dry-run` in a fresh interpreter; the peak RSS (VmHWM) is reported over an idle
interpreter that made the same imports. The cap is a third of the checkpoint's size on disk (its dtype).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys
from pathlib import Path
import torch, transformers, accelerate, safetensors.torch
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from layerprune.core.settings import RunSettings
import layerprune.models.identity, layerprune.models.blockwise, layerprune.prune.blockwise
torch.set_num_threads(2)
mode, model, score, samples = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
out = {}
if mode != "idle":
    recipe = PruneRecipe(drop=4, score=score, calib="arithmetic", calib_samples=samples, batch_size=samples)
    settings = RunSettings(device="cpu", dtype="float32", block_major=mode == "block-major")
    report = prune_model(model, recipe, settings, dry_run=True).report
    out = {"scores": report["scores"], "dropped": report["dropped"], "plan": report["score_details"].get("memory_plan"),
           "location": report["source"]["location"], "score_s": report["timings"]["score_s"]}
out["hwm"] = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(json.dumps(out))
"""


def run(mode: str, args: argparse.Namespace) -> dict:
    env = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    done = subprocess.run([sys.executable, "-c", CHILD, mode, args.model, args.score, str(args.samples)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_deep_model(depth: int, root: Path) -> str:
    """A random float32 Llama with `depth` blocks of width 1024 and the embedded model's tokenizer, saved in `root`."""
    code = f"""
import torch, transformers
from layerprune.models.loading import load_tokenizer, resolve_model
from layerprune.core.settings import RunSettings
tokenizer = load_tokenizer(resolve_model("embedded", RunSettings()))
config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=2816,
    num_hidden_layers={depth}, num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)
model.save_pretrained({str(root)!r}, max_shard_size="256MB")
tokenizer.save_pretrained({str(root)!r})
"""
    env = {"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return str(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--score", default="ablation", choices=["ablation", "block-influence", "angular"])
    parser.add_argument("--samples", type=int, default=8, help="calibration items (arithmetic probes), one batch")
    parser.add_argument("--deep", type=int, default=0, help="score a random Llama with this many blocks instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deep-llama-") as tmp:
        if args.deep:
            args.model = make_deep_model(args.deep, Path(tmp))
        compare(args)


def compare(args: argparse.Namespace) -> None:
    idle = run("idle", args)
    memory = run("in-memory", args)
    block = run("block-major", args)
    size = sum(p.stat().st_size for p in Path(block["location"]).glob("*.safetensors"))
    mib = 2**20
    diff = max(abs(a - b) for a, b in zip(memory["scores"], block["scores"], strict=False) if a is not None)
    print(f"{args.model}: checkpoint {size / mib:.0f} MiB (float32), cap = a third = {size / 3 / mib:.0f} MiB; "
          f"{args.score}, {args.samples} arithmetic items")
    print(f"{'scorer':>12s} {'peak RSS over idle':>18s} {'/ model':>8s} {'under cap':>9s} {'score s':>8s}  dropped")
    for name, result in (("in-memory", memory), ("block-major", block)):
        peak = result["hwm"] - idle["hwm"]
        print(f"{name:>12s} {peak / mib:14.0f} MiB {peak / size:8.2f} {str(peak <= size / 3):>9s} "
              f"{result['score_s']:8.1f}  {result['dropped']}")
    plan = block["plan"]
    print(f"plan printed before scoring: peak {plan['peak_bytes'] / mib:.0f} MiB "
          f"(resident {plan['resident_bytes'] / mib:.0f}, block {plan['block_bytes'] / mib:.1f}, "
          f"{plan['states']} states x {plan['state_bytes'] / mib:.2f} MiB)")
    print(f"max |score difference| block-major vs in-memory: {diff:.2e}")


if __name__ == "__main__":
    main()
