"""Per-program cost of the sandbox's isolation, against a plain `python -c` subprocess, side by side.

    .venv/bin/python bench/bench_sandbox.py [--runs 30]

Runs the same small program (a HumanEval-sized function and its asserts) interleaved: as a plain
subprocess (`python -I -B -c`), through the sandbox without isolation (--unsafe-code-exec: launcher and
wrapper only) and through the sandbox with the isolation this machine allows. Prints the median wall time
and the CPU time (user + system of the children) per program, and the overhead over the plain subprocess.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from layerprune.evaluate.sandbox import SandboxLimits, available_isolation, execute

PROGRAM = ("def sort_third(l):\n    l = list(l)\n    l[::3] = sorted(l[::3])\n    return l\n"
           "assert sort_third([5, 6, 3, 4, 8, 9, 2]) == [2, 6, 3, 4, 8, 9, 5]\n"
           "assert sort_third([1, 2, 3]) == [1, 2, 3]\n")


def timed(call) -> tuple[float, float]:
    """(wall seconds, children's CPU seconds) of one call."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    call()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return time.perf_counter() - start, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    mode, why = available_isolation()
    limits = SandboxLimits(timeout_s=10)
    arms = {"plain python -c": lambda: subprocess.run([sys.executable, "-I", "-B", "-c", PROGRAM], check=True),
            "sandbox, no isolation": lambda: execute(PROGRAM, limits, "none")}
    if mode != "none":
        arms[f"sandbox, isolation {mode}"] = lambda: execute(PROGRAM, limits, mode)
    else:
        print(f"no isolation on this machine: {why}")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    for _ in range(args.runs):
        for name, call in arms.items():
            times[name].append(timed(call))
    base_wall = statistics.median(w for w, _ in times["plain python -c"])
    base_cpu = statistics.median(c for _, c in times["plain python -c"])
    print(f"{'arm':<28} {'wall ms':>8} {'cpu ms':>8} {'+wall ms':>9} {'+cpu ms':>8} {'ratio':>6}")
    for name, rows in times.items():
        wall, cpu = statistics.median(w for w, _ in rows), statistics.median(c for _, c in rows)
        print(f"{name:<28} {wall * 1e3:8.1f} {cpu * 1e3:8.1f} {(wall - base_wall) * 1e3:9.1f} "
              f"{(cpu - base_cpu) * 1e3:8.1f} {wall / base_wall:6.2f}")
    print(f"load average during the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
