"""Converting the embedded GGUFs to safetensors: layerprune's one fast parse against transformers' three, side by side.

    python bench/bench_gguf_convert.py            # SmolLM2-135M-Instruct and Gemma-3-270M, each way, alternating

transformers' GGUF loader parses the file's metadata for the config, the tokenizer and the weights, each time with
gguf's reader (one memmap slice per vocabulary entry); Gemma-3's 262,144-token vocabulary makes each parse seconds
of Python. `convert_gguf` loads all three under `parsed_once()`: one parse by `fast_reader`, the values parsed once.
Prints, per model, gguf's reader against the fast one on the file's metadata alone, then each conversion's
seconds, the ratio (ours / transformers' own) and whether the two outputs hold equal tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from layerprune.models import embedded, loading
from layerprune.models.gguf_once import fast_reader, parsed_once


def parse_seconds(path: Path, fast: bool) -> float:
    import gguf

    start = time.perf_counter()
    (fast_reader if fast else gguf.GGUFReader)(path)
    return time.perf_counter() - start


def convert(path: Path, target: Path, once: bool) -> float:
    loading.parsed_once = parsed_once if once else contextlib.nullcontext  # the module's own name, swapped
    start = time.perf_counter()
    try:
        loading.convert_gguf(path, target)
    finally:
        loading.parsed_once = parsed_once
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for name in args.models.split(","):
            path = embedded.gguf_path(embedded.EMBEDDED_MODELS[name], work / "cache")
            stock, fast = parse_seconds(path, fast=False), parse_seconds(path, fast=True)
            print(f"{name}: metadata parse, gguf's reader {stock:.2f} s, fast_reader {fast:.2f} s, "
                  f"ratio {fast / stock:.3f}x")
            three = convert(path, work / f"{name}-three", once=False)
            once = convert(path, work / f"{name}-once", once=True)
            a = load_file(work / f"{name}-three" / "model.safetensors")
            b = load_file(work / f"{name}-once" / "model.safetensors")
            equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            print(f"{name}: conversion, transformers' three parses {three:.1f} s, ours {once:.1f} s, "
                  f"ratio {once / three:.2f}x; "
                  f"tensors equal: {equal}")


if __name__ == "__main__":
    main()
