"""Streaming prune vs `cp -r` vs the in-memory path, on a random bf16 Llama-shaped checkpoint in 256 MB shards.

    nice -n 15 python bench/bench_stream_prune.py [--gb 1.1] [--repeats 3] [--skip-in-memory] [--threads N]
        [--baseline-src OTHER/src] [--only stream]

Each variant runs in a fresh interpreter; its peak RSS (VmHWM) is reported over an idle interpreter that made
the same imports, and its work time excludes interpreter start and imports. Each run of a variant is paired with a
`cp -r` of the checkpoint just before it (same load, same page cache) and the median ratio is printed. "first run"
variants get a fresh cache, so the source's sha256 (the report's weights hash) is computed; "memoized" ones reuse
it. `--baseline-src` runs the same variants with another checkout's `src` too, interleaved (before/after in one
run). Times are wall and CPU (user + sys of every thread; for `cp -r` its own, from the kernel's account of the
child), both as ratios to the same `cp -r`: on a busy machine the wall ratio moves with the load, the CPU one much
less. The breakdown columns come from the prune report: save (copy, with the hash on a first run), the byte-for-byte
comparison, the per-layer settings, the original's block-major logits with the blocks skipped, the written model's.
`--threads N` sets OMP_NUM_THREADS for the prune (default: torch's own choice). Targets (issue 39): streamed time
<= 2x `cp -r` with verification on, peak RSS <= 1.5x the larger of the largest input and output shard, every tensor
bit-identical and in bf16.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from layerprune.core.settings import RunSettings
from layerprune.models import drop_blocks
import layerprune.models.identity, transformers.models.llama.modeling_llama, safetensors.torch  # imports are not work
mode, source, out, cache = sys.argv[1:5]
settings = RunSettings(max_shard_size="256MB", cache_dir=Path(cache))
start, cpu = time.perf_counter(), time.process_time()
check, phases = None, {}
if mode in ("stream", "stream-no-verify"):
    report = prune_model(source, PruneRecipe(layers=[2, 5], verify=mode == "stream"), settings, output=Path(out)).report
    check = report["verification"].get("logits_check", "none (--no-verify)")
    phases = {"save": report["timings"]["save_s"], **report["verification"].get("phase_seconds", {})}
elif mode == "memory":
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    drop_blocks(model, [2, 5])
    model.save_pretrained(out, max_shard_size="256MB")
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(json.dumps({"seconds": seconds, "cpu": cpu, "hwm": hwm, "check": check, "phases": phases,
                  "threads": torch.get_num_threads()}))
"""


def make_checkpoint(directory: Path, gb: float) -> int:
    """Random bf16 tensors named and shaped like a Llama (hidden 2048), written shard by shard (256 MB); returns the
    bytes of one block."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import tiny_tokenizer

    per_layer = 2 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632)
    layers = max(4, round((gb * 1e9 - 2 * 2 * 32000 * 2048) / per_layer))
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).state_dict()
    split = split_torch_state_dict_into_shards(meta, max_shard_size="256MB")
    gen = torch.Generator().manual_seed(0)
    for filename, names in split.filename_to_tensors.items():
        shard = {n: (torch.randn(meta[n].shape, generator=gen) * 0.02).to(torch.bfloat16) for n in names}
        save_file(shard, directory / filename, metadata={"format": "pt"})
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return per_layer


def run_child(mode: str, source: Path, out: Path, cache: Path, src: Path = ROOT / "src",
              threads: int | None = None) -> dict:
    env = {"PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(source), str(out), str(cache)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_cp(source: Path, target: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + sys) of `cp -r source target`; the copy is removed after."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(target)], check=True)
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(target)
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def check_bits(source: Path, out: Path) -> tuple[int, set[str]]:
    """Every output tensor equals its source tensor (renamed), byte for byte; return count and dtypes."""
    import torch
    from safetensors import safe_open

    from layerprune.models.shards import block_prefix, read_checkpoint, rename_map

    src, dst = read_checkpoint(source), read_checkpoint(out)
    depth = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    renamed = rename_map(list(src.weight_map), block_prefix(list(src.weight_map), depth),
                         [i for i in range(depth) if i not in (2, 5)], depth)
    dtypes = set()
    for old, new in renamed.items():
        with safe_open(source / src.weight_map[old], "pt") as a, safe_open(out / dst.weight_map[new], "pt") as b:
            x, y = a.get_tensor(old), b.get_tensor(new)
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), old
            dtypes.add(str(y.dtype))
    assert set(dst.weight_map) == set(renamed.values())
    return len(renamed), dtypes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.1, help="checkpoint size in GB (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (the median is printed)")
    parser.add_argument("--skip-in-memory", action="store_true", help="skip the load + save_pretrained reference")
    parser.add_argument("--baseline-src", type=Path, help="another checkout's src/, run side by side (before/after)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the prune (default: torch's choice)")
    parser.add_argument("--only", choices=["stream", "stream-no-verify"], help="run only this mode's variants")
    args = parser.parse_args()
    trees = [("this tree", ROOT / "src")] + ([("baseline", args.baseline_src.resolve())] if args.baseline_src else [])
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        root = Path(tmp)
        source = root / "source"
        source.mkdir()
        block = make_checkpoint(source, args.gb)
        shards = sorted(source.glob("*.safetensors"))
        total, largest = sum(s.stat().st_size for s in shards), max(s.stat().st_size for s in shards)
        depth = json.loads((source / "config.json").read_text())["num_hidden_layers"]
        print(f"checkpoint: {total / 1e9:.2f} GB bf16 in {len(shards)} shards, largest {largest / 2**20:.0f} MiB, "
              f"{depth} blocks of {block / 2**20:.0f} MiB; drop blocks 2 and 5")
        time_cp(source, root / "warm")  # page cache warm for everyone
        idle = run_child("idle", source, root / "none", root / "cache")
        variants = [("streamed, first run (hashes the source), verification on", "stream", None),
                    ("streamed, first run (hashes the source), --no-verify", "stream-no-verify", None),
                    ("streamed, hash memoized, verification on", "stream", "memo"),
                    ("streamed, hash memoized, --no-verify", "stream-no-verify", "memo")]
        if args.only:
            variants = [variant for variant in variants if variant[1] == args.only]
        if not args.skip_in_memory:
            variants.append(("load + drop_blocks + save_pretrained (old path, bf16)", "memory", "memo"))
        pairs: dict[tuple[str, str], list[tuple]] = {}
        for index in range(args.repeats):  # every variant once per round, cp -r just before each
            for label, mode, cache in variants:
                for tree, src in trees:
                    cp, cp_cpu = time_cp(source, root / "cp")
                    out = root / "out"
                    cache_dir = root / (f"memo-{tree}" if cache else f"fresh-{tree}-{mode}-{index}")
                    result = run_child(mode, source, out, cache_dir, src, args.threads)
                    out_largest = max(f.stat().st_size for f in out.glob("*.safetensors"))
                    pairs.setdefault((tree, label), []).append(
                        (result["seconds"] / cp, result["cpu"] / cp_cpu, result, cp, cp_cpu,
                         max(largest, out_largest)))
                    if mode.startswith("stream"):
                        count, dtypes = check_bits(source, out)
                    shutil.rmtree(out)
        print_table(pairs, idle["hwm"])
        print(f"bit-identical: {count} tensors, dtypes {sorted(dtypes)}")


def print_table(pairs: dict[tuple[str, str], list[tuple]], idle: int) -> None:
    """One line per tree and variant: the median run by wall ratio, its CPU ratio, peak RSS and breakdown."""
    print(f"{'tree':9s} {'variant (median of runs by wall ratio to the cp -r just before)':63s} {'wall s':>6s} "
          f"{'cp s':>5s} {'/cp':>5s} {'cpu s':>6s} {'cp cpu':>6s} {'/cp':>5s} {'RSS MiB':>7s} {'/shard':>6s} "
          f"{'thr':>3s}  breakdown (s, wall)")
    for (tree, label), runs in pairs.items():
        ratio, cpu_ratio, result, cp, cp_cpu, shard = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
        rss = result["hwm"] - idle
        phases = " ".join(f"{name} {seconds:.2f}" for name, seconds in result["phases"].items())
        print(f"{tree:9s} {label:63s} {result['seconds']:6.2f} {cp:5.2f} {ratio:5.2f} {result['cpu']:6.2f} "
              f"{cp_cpu:6.2f} {cpu_ratio:5.2f} {rss / 2**20:7.0f} {rss / shard:6.2f} {result['threads']:3d}  "
              f"{phases or result['check']}")


if __name__ == "__main__":
    main()
