"""GGUF export of the embedded models, pruned, verified by both readers; llama.cpp's build time once.

    python bench/bench_gguf.py                  # SmolLM2-135M and Gemma-3-270M, 4 blocks dropped, F16 and Q8_0
    python bench/bench_gguf.py --models embedded:gemma3-270m --outtypes f16   # one model, one type
    python bench/bench_gguf.py --build          # first: time `pip wheel llama-cpp-python` (cmake build) and install

Per model and type: file size, transformers read-back (max |logit diff|, top-1 agreement) and llama.cpp
(llama-cpp-python) against transformers: tokenization, top-1 at every prompt position, greedy continuations.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {"embedded": [20, 21, 22, 23], "embedded:gemma3-270m": [3, 4, 5, 9]}


def build_llama_cpp(wheels: Path) -> float:
    """Seconds to build llama-cpp-python from source (pip wheel, cmake), then install the wheel."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "llama-cpp-python", "-w", str(wheels)],
                   check=True)
    seconds = time.perf_counter() - start
    wheel = sorted(wheels.glob("llama_cpp_python-*.whl"))[-1]
    subprocess.run([sys.executable, "-m", "pip", "install", str(wheel)], check=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="Build and install llama-cpp-python first (timed)")
    parser.add_argument("--outtypes", default="f16,q8_0")
    parser.add_argument("--models", default=",".join(CASES), help="Which of the embedded models (comma-separated)")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    if args.build:
        print(json.dumps({"llama_cpp_build_s": round(build_llama_cpp(work / "wheels"), 1)}), flush=True)
    from layerprune.cli import main as cli
    from layerprune.export import export_gguf
    from layerprune.export.llamacpp import compare_with_transformers

    for model in args.models.split(","):
        drop = CASES[model]
        pruned = work / model.replace(":", "-")
        if not (pruned / "config.json").is_file():
            cli(["-q", "prune", "--model", model, "--layers", ",".join(map(str, drop)), "-o", str(pruned)])
        for outtype in args.outtypes.split(","):
            path = work / f"{pruned.name}-{outtype}.gguf"
            report = export_gguf(pruned, path, outtype, overwrite=True)
            row = {"model": model, "dropped": drop, "outtype": outtype, "mb": round(report.bytes / 1e6),
                   "export_s": report.seconds, "transformers_readback": report.readback,
                   "llama_cpp": compare_with_transformers(path, pruned)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
