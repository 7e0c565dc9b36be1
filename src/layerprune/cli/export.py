"""`layerprune export DIR --gguf OUT.gguf`: a pruned or recovered model as one GGUF file for llama.cpp / Ollama."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_schema
from layerprune.core.settings import RunSettings
from layerprune.models.gguf_types import OUTTYPES

QUANTS = ("q4_k_m", "q5_k_m", "q6_k")  # the common ones; export/quantize.py has them all


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="A pruned or recovered model directory")
    parser.add_argument("--gguf", type=Path, required=True, help="The .gguf file to write")
    parser.add_argument("--outtype", default="q8_0", metavar="TYPE",
                        help=f"Encoding of the 2-D weights (1-D tensors stay F32): {', '.join(OUTTYPES)}, or a type "
                             f"llama.cpp's quantizer makes from F16 ({', '.join(QUANTS)}, ...; needs llama-cpp-python,"
                             " and --verify runs the result in llama.cpp against transformers) (default: q8_0)")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing file")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="Read the file back with transformers' GGUF loader and compare logits (default: on)")
    add_schema_flags(parser, RunSettings, group="how to run")


def run(args: argparse.Namespace) -> int:
    from layerprune.export import export_gguf

    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    report = export_gguf(args.model, args.gguf, args.outtype, args.overwrite, args.verify, settings)
    print(f"wrote {report.output} ({report.architecture}, {report.outtype}, {report.bytes / 1e6:.0f} MB, "
          f"{report.tensors} tensors) in {report.seconds} s; tokenizer from {Path(report.tokenizer_from).name}")
    if report.quantized and report.readback:
        back = report.readback
        print(f"run by llama.cpp: {back['verdict']}, top-1 {back['top1_agreement']} with transformers, mean KL "
              f"{back['mean_kl']} nats (tolerance {back['tolerance']}); "
              f"tensor types {report.quantized['tensor_types']}")
    elif report.readback:
        back = report.readback
        print(f"read back by transformers: {back['verdict']}, top-1 {back['top1_agreement']}, max |logit diff| "
              f"{back['max_abs_logit_diff']} (logits up to {back['logit_scale']}), tokenizer ids equal: "
              f"{back['tokenizer_ids_equal']}")
    print(f"chat with it: llama-cli -m {report.output} -cnv   (or Ollama: FROM {report.output} in a Modelfile)")
    return 0
