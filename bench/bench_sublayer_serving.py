"""Sublayer pruning of the embedded SmolLM2-135M, served: the Nemotron-NAS folder in vLLM, its GGUF in llama.cpp.

    python bench/bench_sublayer_serving.py                       # F16 and Q8_0; vLLM where --vllm-python names one
    python bench/bench_sublayer_serving.py --vllm-python .venv-vllm/bin/python

Prunes the named sublayers (float32), exports each GGUF type (read back tensor by tensor), runs it with llama.cpp
(llama-cpp-python) against transformers on the verification prompts (tokenization, top-1 at every prompt position,
greedy continuations) and, given a vLLM Python, runs `check-serve` (vLLM's own nemotron_nas model) on the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REMOVED = "20.attn,22.attn,24.attn,25.mlp,27.attn,27.mlp,28.attn"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=REMOVED, help="Sublayers to remove (BLOCK.attn / BLOCK.mlp)")
    parser.add_argument("--outtypes", default="f16,q8_0")
    parser.add_argument("--vllm-python", default=os.environ.get("LAYERPRUNE_VLLM_PYTHON"))
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-sublayers-"))
    from layerprune.cli import main as cli
    from layerprune.export import export_gguf
    from layerprune.export.llamacpp import compare_with_transformers

    pruned = work / "pruned"
    if not (pruned / "config.json").is_file():
        cli(["-q", "prune", "--model", "embedded", "--granularity", "sublayer", "--layers", args.layers,
             "--dtype", "float32", "-o", str(pruned)])
    report = json.loads((pruned / "prune_report.json").read_text())
    print(json.dumps({"removed": report["removed_sublayers"], "params": [report["params_before"],
                      report["params_after"]], "kv_cache_kept": report["kv_cache_kept"],
                      "verification": report["verification"]}), flush=True)
    for outtype in args.outtypes.split(","):
        path = work / f"pruned-{outtype}.gguf"
        exported = export_gguf(pruned, path, outtype, overwrite=True)
        row = {"outtype": outtype, "mb": round(exported.bytes / 1e6, 1), "readback": exported.readback,
               "llama_cpp": compare_with_transformers(path, pruned)}
        print(json.dumps(row), flush=True)
    if args.vllm_python:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        subprocess.run([args.vllm_python, "-m", "layerprune.cli", "check-serve", str(pruned)], env=env, check=False)
        print(json.dumps({"vllm": json.loads((pruned / "serve_check.json").read_text())}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
