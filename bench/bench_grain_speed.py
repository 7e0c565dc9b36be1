"""The grain study's cells, timed: at equal parameters removed, how much faster is each grain?

    .venv/bin/python bench/bench_grain_speed.py                                   # docs/records/grain-embedded.tar.gz
    .venv/bin/python bench/bench_grain_speed.py --plan runs/grain-embedded/grain_plan.json --repeats 5

Reads the study's plan (`grain_plan.json`, from a run directory or from its packed records) and times every cell
against the original, each as it is served: whole blocks dropped from the model (a standard config), attention or MLP
sublayers removed as the Nemotron-NAS layout runs them (a DeciLM model sharing the kept weights). Printed per cell:
parameters and KV cache removed, the speedup the FLOP model predicts, measured prefill and decode speedups and their
minimum (what `--target speedup=` counts), measured / predicted. The candidate and the original are timed
alternately, fastest of `--repeats` kept; by default this process's CPU seconds on one thread (`--clock cpu`: fair on
a loaded machine; the load average is printed), `--clock wall` for what a user sees on an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import tarfile
from pathlib import Path

RECORDS = Path(__file__).resolve().parents[1] / "docs" / "records" / "grain-embedded.tar.gz"


def read_plan(path: Path) -> dict:
    if path.suffixes[-2:] == [".tar", ".gz"]:
        with tarfile.open(path, "r:gz") as tar:
            return json.load(tar.extractfile("grain_plan.json"))
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, default=RECORDS, help="grain_plan.json or a study's records .tar.gz")
    parser.add_argument("--model", default=None, help="model spec (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy decode steps timed")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()

    import torch

    from layerprune.models import load_model
    from layerprune.models.speed import SpeedBench, measured_removal_speedup
    from layerprune.models.sublayers import parse_sublayer
    from layerprune.prune.target import model_sizes

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model = loaded.model.eval()
    sizes = model_sizes(model, next(model.parameters()).dtype)
    bench = SpeedBench(prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats, clock=args.clock)
    plan = read_plan(args.plan)
    print(f"model {loaded.source.spec}, {torch.get_num_threads()} thread(s), {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; plan {args.plan} (matched on {plan['match']}); benchmark {bench}")
    print(f"{'cell':<14} {'removals':>8} {'params':>7} {'KV':>5} {'predicted':>9} {'prefill':>8} {'decode':>7} "
          f"{'measured':>8} {'meas/pred':>9}")
    for name, cell in plan["cells"].items():
        removals = [int(r) if cell["grain"] == "block" else parse_sublayer(str(r)) for r in cell["removals"]]
        measured = measured_removal_speedup(model, removals, bench)
        predicted = sizes.predicted(removals)["speedup"]
        share = f"{100 * cell['params_fraction']:>6.1f}% {100 * cell['kv_fraction']:>4.0f}%"
        print(f"{name:<14} {len(removals):>8} {share} "
              f"{predicted:>8.3f}x {measured['prefill_speedup']:>7.3f}x {measured['decode_speedup']:>6.3f}x "
              f"{measured['speedup']:>7.3f}x {measured['speedup'] / predicted:>9.3f}", flush=True)
    print(f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
