"""Streaming prune vs `cp -r` vs the in-memory path, on random bf16 Llama-shaped checkpoints in 256 MB shards.

    nice -n 15 python bench/bench_stream_prune.py [--shapes 32x1024,8b] [--repeats 3] [--skip-in-memory]
        [--threads N] [--baseline-src OTHER/src] [--only stream]

Shapes, printed side by side (issue 57): `32x1024` (32 blocks of hidden 1024, MHA, intermediate 4096, vocabulary
32000: 1.20 GB) and `8b` (Llama-3.1-8B's shape: 32 blocks of hidden 4096, intermediate 14336, 8 KV heads,
vocabulary 128256: 16.1 GB), both pruned with `--layers 3,4,5,6,7,20,21,22`; `gb` is the older 9-block hidden-2048
checkpoint of `--gb` GB, pruned with `--layers 2,5`. A shape whose checkpoint, copy and output do not fit the free
disk (three times its size) is skipped with a line saying so.

Each variant runs in a fresh interpreter; its peak RSS (VmHWM) is reported over an idle interpreter that made the
same imports, and its work time excludes interpreter start and imports. Each run of a variant is paired with a
`cp -r` of the checkpoint just before it (same load, same page cache) and the median ratio is printed. "first run"
variants get a fresh cache, so the source's identity (the report's `weights_xxh3_128`) is computed, from the copy's
own pass; "memoized" ones reuse it. `--baseline-src` runs the same variants with another checkout's `src` too,
interleaved (before/after in one run). Times are wall and CPU (user + sys of every thread; for `cp -r` its own, from
the kernel's account of the child), both as ratios to the same `cp -r`: on a busy machine the wall ratio moves with
the load, the CPU one much less. The breakdown columns come from the prune report: save (copy, with the identity on
a first run), the byte-for-byte comparison, the per-layer settings, the original's block-major logits with the
blocks skipped, the written model's.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
mode, source, out, cache, layers = sys.argv[1:6]
layers = json.loads(layers)
settings = RunSettings(max_shard_size="256MB", cache_dir=Path(cache))
start, cpu = time.perf_counter(), time.process_time()
check, phases = None, {}
if mode in ("stream", "stream-no-verify"):
    report = prune_model(source, PruneRecipe(layers=layers, verify=mode == "stream"), settings, output=Path(out)).report
    check = report["verification"].get("logits_check", "none (--no-verify)")
    phases = {"save": report["timings"]["save_s"], **report["verification"].get("phase_seconds", {})}
elif mode == "memory":
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    drop_blocks(model, layers)
    model.save_pretrained(out, max_shard_size="256MB")
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(json.dumps({"seconds": seconds, "cpu": cpu, "hwm": hwm, "check": check, "phases": phases,
                  "threads": torch.get_num_threads()}))
"""


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped checkpoint and the blocks its prune drops."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int
    drop: tuple[int, ...]

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, tie_word_embeddings=False, dtype="bfloat16")

    @property
    def block_bytes(self) -> int:
        kv = self.hidden // self.heads * self.kv_heads
        return 2 * (2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate)

    @property
    def nbytes(self) -> int:
        return self.layers * self.block_bytes + 2 * 2 * self.vocab * self.hidden


ISSUE_DROP = (3, 4, 5, 6, 7, 20, 21, 22)  # issue 57's case


def shapes(gb: float) -> dict[str, Shape]:
    per_layer = Shape(2048, 5632, 16, 4, 32000, 1, ()).block_bytes
    return {"32x1024": Shape(1024, 4096, 16, 16, 32000, 32, ISSUE_DROP),
            "8b": Shape(4096, 14336, 32, 8, 128256, 32, ISSUE_DROP),
            "gb": Shape(2048, 5632, 16, 4, 32000, max(4, round((gb * 1e9 - 2 * 2 * 32000 * 2048) / per_layer)), (2, 5))}


def make_checkpoint(directory: Path, shape: Shape) -> int:
    """Random bf16 tensors named and shaped like a Llama of `shape`, written shard by shard (256 MB); returns the
    bytes of one block."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import tiny_tokenizer

    config = shape.config()
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
    return shape.block_bytes


def run_child(mode: str, source: Path, out: Path, cache: Path, drop: tuple[int, ...], src: Path = ROOT / "src",
              threads: int | None = None) -> dict:
    env = {"PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(source), str(out), str(cache),
                           json.dumps(list(drop))], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_cp(source: Path, target: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + sys) of `cp -r source target`; the copy is removed after."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(target)], check=True)
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(target)
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def check_bits(source: Path, out: Path, drop: tuple[int, ...]) -> tuple[int, set[str]]:
    """Every output tensor equals its source tensor (renamed), byte for byte; return count and dtypes."""
    import torch
    from safetensors import safe_open

    from layerprune.models.shards import block_prefix, read_checkpoint, rename_map

    src, dst = read_checkpoint(source), read_checkpoint(out)
    depth = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    renamed = rename_map(list(src.weight_map), block_prefix(list(src.weight_map), depth),
                         [i for i in range(depth) if i not in drop], depth)
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
    parser.add_argument("--shapes", default="32x1024,8b", help="comma-separated: 32x1024, 8b, gb (see above)")
    parser.add_argument("--gb", type=float, default=1.1, help="the `gb` shape's checkpoint size in GB (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (the median is printed)")
    parser.add_argument("--skip-in-memory", action="store_true", help="skip the load + save_pretrained reference")
    parser.add_argument("--baseline-src", type=Path, help="another checkout's src/, run side by side (before/after)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the prune (default: torch's choice)")
    parser.add_argument("--only", choices=["stream", "stream-no-verify"], help="run only this mode's variants")
    args = parser.parse_args()
    trees = [("this tree", ROOT / "src")] + ([("baseline", args.baseline_src.resolve())] if args.baseline_src else [])
    known = shapes(args.gb)
    for name in args.shapes.split(","):
        shape = known[name]
        with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
            free = shutil.disk_usage(tmp).free
            if 3 * shape.nbytes > free:
                print(f"{name}: skipped: {shape.nbytes / 1e9:.1f} GB checkpoint, needs {3 * shape.nbytes / 1e9:.0f} "
                      f"GB free for it, its copy and the output; {free / 1e9:.0f} GB free")
                continue
            run_shape(name, shape, Path(tmp), trees, args)


def run_shape(name: str, shape: Shape, root: Path, trees: list[tuple[str, Path]], args: argparse.Namespace) -> None:
    """Build the checkpoint, run every variant `args.repeats` times next to a `cp -r`, print the table."""
    source = root / "source"
    source.mkdir()
    block = make_checkpoint(source, shape)
    files = sorted(source.glob("*.safetensors"))
    total, largest = sum(f.stat().st_size for f in files), max(f.stat().st_size for f in files)
    print(f"\n{name}: {total / 1e9:.2f} GB bf16 in {len(files)} shards, largest {largest / 2**20:.0f} MiB, "
          f"{shape.layers} blocks of {block / 2**20:.0f} MiB (hidden {shape.hidden}); --layers "
          f"{','.join(map(str, shape.drop))}")
    time_cp(source, root / "warm")  # page cache warm for everyone
    idle = run_child("idle", source, root / "none", root / "cache", shape.drop)
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
                result = run_child(mode, source, out, cache_dir, shape.drop, src, args.threads)
                out_largest = max(f.stat().st_size for f in out.glob("*.safetensors"))
                pairs.setdefault((tree, label), []).append(
                    (result["seconds"] / cp, result["cpu"] / cp_cpu, result, cp, cp_cpu, max(largest, out_largest)))
                if mode.startswith("stream"):
                    count, dtypes = check_bits(source, out, shape.drop)
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
