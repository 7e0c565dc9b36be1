"""`prune --target speedup=`: the speedup predicted (from a timed profile, and from FLOPs) against the one measured.

    .venv/bin/python bench/bench_target_speedup.py                      # SmolLM2-135M (embedded), 1.2x 1.4x 1.6x
    .venv/bin/python bench/bench_target_speedup.py --targets 1.3 --repeats 5
    .venv/bin/python bench/bench_target_speedup.py --granularity attention --targets 1.1 1.2   # sublayers

For each target the search of `plan_blocks` runs as `prune --target speedup=X` does (blocks ranked last-first, a
data-free order: the speed of a candidate depends on how many blocks go, not on which), and every candidate it
measured is printed: blocks removed, predicted speedup, measured prefill and decode speedups, and measured /
predicted. The issue asks them to agree within 10% on this CPU. Wall-clock figures: on a loaded machine they
are noisy (the load average is printed), so by default the bench counts this process's CPU seconds on one thread
(`--clock cpu`; `prune` itself times the wall clock); the candidate and the original are timed alternately,
fastest of `--repeats` kept. `--granularity attention | mlp | sublayer` plans sublayer removals instead (the
layout-servable order, later blocks first), each candidate timed as the Nemotron-NAS layout runs it.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model spec (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--targets", nargs="+", type=float, default=[1.2, 1.4, 1.6])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--granularity", choices=["block", "attention", "mlp", "sublayer"], default="block")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: this process's CPU seconds (fair on a loaded machine); wall: what prune uses")
    args = parser.parse_args()

    import torch

    from layerprune.models import find_decoder_stack, load_model
    from layerprune.models.speed import SpeedBench
    from layerprune.models.sublayers import all_sublayers
    from layerprune.prune.recipe import PruneRecipe
    from layerprune.prune.sublayer_scores import servable_order
    from layerprune.prune.target import parse_target, plan_blocks, plan_sublayers

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model = loaded.model.eval()
    depth = len(find_decoder_stack(model))
    dtype = next(model.parameters()).dtype
    bench = SpeedBench(repeats=args.repeats, clock=args.clock)
    print(f"model {loaded.source.spec}: {depth} blocks, {model.num_parameters() / 1e6:.1f}M parameters, {dtype}, "
          f"{model.device}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; benchmark {bench}")
    scores = [float(depth - 1 - i) for i in range(depth)]
    parts = PruneRecipe(drop=1, granularity=args.granularity).parts
    order = servable_order({sub: float(depth - 1 - sub.block) for sub in all_sublayers(depth, parts)}, depth)
    unit = "blocks" if args.granularity == "block" else "subs"

    def plan_for(value: float):  # noqa: ANN202
        target = parse_target(f"speedup={value}x")
        if args.granularity == "block":
            return plan_blocks(model, target, scores, [0], dtype, bench)
        return plan_sublayers(model, target, order, dtype, bench)

    print(f"{'target':>7} {unit:>6} {'predicted':>9} {'FLOPs':>7} {'prefill':>8} {'decode':>7} {'measured':>8} "
          f"{'meas/pred':>9} {'meas/FLOPs':>10}")
    ratios, flops = [], []
    for value in args.targets:
        start = time.perf_counter()
        plan = plan_for(value)
        for row in plan.measured:
            ratio = row["speedup"] / row["predicted"]
            ratios.append(ratio)
            flops.append(row["speedup"] / row["predicted_flops"])
            chosen = "*" if row["removals"] == len(plan.removals) else " "
            print(f"{value:>6.2f}x {row['removals']:>5}{chosen} {row['predicted']:>8.3f}x "
                  f"{row['predicted_flops']:>6.3f}x {row['prefill_speedup']:>7.3f}x {row['decode_speedup']:>6.3f}x "
                  f"{row['speedup']:>7.3f}x {ratio:>9.3f} {flops[-1]:>10.3f}")
        print(f"        target {value}x: {len(plan.removals)} {unit} ({time.perf_counter() - start:.0f}s)")
    for name, values in (("predicted (profile)", ratios), ("predicted from FLOPs", flops)):
        worst = max(abs(r - 1) for r in values)
        print(f"measured / {name} over {len(values)} candidates: {min(values):.3f} .. {max(values):.3f} "
              f"(worst {100 * worst:.1f}% off)")
    print(f"load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
