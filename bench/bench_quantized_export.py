"""Depth and bits together: the embedded SmolLM2-135M, unpruned and pruned, exported at F16, Q8_0 and llama.cpp's
k-quants, each run by llama.cpp (llama-cpp-python) against transformers on the same model directory.

    python bench/bench_quantized_export.py
    python bench/bench_quantized_export.py --outtypes f16,q4_k_m --work /tmp/bench-quant

Per (model, type): file size, the tensor types llama.cpp's quantizer chose, mean KL(transformers || llama.cpp) and
top-1 agreement at every position of the verification prompts (39 positions), tokenization and greedy continuation
agreement (4 prompts, 16 tokens). F16 and Q8_0 are written by the gguf package; the others by llama.cpp's quantizer
from the F16 file. Markdown rows at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

PRUNES = {"unpruned": None, "blocks 20-23": ["--layers", "20,21,22,23"],
          "7 sublayers": ["--granularity", "sublayer", "--layers",
                          "20.attn,22.attn,24.attn,25.mlp,27.attn,27.mlp,28.attn"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outtypes", default="f16,q8_0,q6_k,q5_k_m,q4_k_m")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-quant-"))
    rows = []
    for label, flags in PRUNES.items():
        model = _model(work, label, flags)
        for outtype in args.outtypes.split(","):
            row = {"model": label, "outtype": outtype, **_measure(model, work / f"{_slug(label)}-{outtype}.gguf",
                                                                   outtype)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| model | type | MB | tensor types | mean KL (nats) | top-1 | greedy equal |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['outtype']} | {row['mb']} | {row['tensor_types']} | {row['mean_kl']} | "
              f"{row['top1']} | {row['greedy']} |")


def _model(work: Path, label: str, flags: list[str] | None) -> Path:
    from layerprune.cli import main as cli
    from layerprune.models.loading import resolve_model

    if flags is None:
        return Path(resolve_model("embedded").location)
    directory = work / _slug(label)
    if not (directory / "config.json").is_file():
        cli(["-q", "prune", "--model", "embedded", *flags, "--dtype", "float32", "--no-verify", "-o", str(directory)])
    return directory


def _measure(model: Path, path: Path, outtype: str) -> dict:
    from layerprune.export import export_gguf
    from layerprune.export.llamacpp import compare_with_transformers
    from layerprune.export.quantize import logit_agreement

    report = export_gguf(model, path, outtype, overwrite=True, verify=False)
    logits = logit_agreement(path, model)
    ran = compare_with_transformers(path, model)
    types = (report.quantized or {}).get("tensor_types") or {f"{outtype.upper()} (2-D; gguf package)": report.tensors}
    return {"mb": round(report.bytes / 1e6, 1), "tensor_types": " ".join(f"{k}:{v}" for k, v in types.items()),
            "mean_kl": logits["mean_kl"], "top1": logits["top1_agreement"], "tokenization": ran["tokenization_equal"],
            "greedy": f"{ran['continuations']['equal']}/{ran['continuations']['of']}",
            "first_difference": ran["continuations"]["first_difference"]}


def _slug(label: str) -> str:
    return label.replace(" ", "-")


if __name__ == "__main__":
    sys.exit(main())
