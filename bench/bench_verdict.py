"""Where the serving verdict's near-tie thresholds come from (models/verification.NEAR_TIE): the embedded
SmolLM2-135M-Instruct (float32) against copies of itself with a rounding-only change or a planted error, each run as
the "engine" through transformers (models/verification.transformers_verdict) on the verification prompts.

    .venv/bin/python bench/bench_verdict.py

Per change, one JSON line: the verdict at the threshold given (--near-tie; default bfloat16's and Q8_0's), the
largest logit error, and the top-2 margin of transformers at every position whose top-1 flipped. Rounding flips
only margins far below the threshold; a wrong model flips some above it.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from typing import Any

import torch


def _q8_0(param: torch.Tensor) -> None:
    """Q8_0's rounding of a 2-D weight in place: blocks of 32, one scale each (absmax / 127)."""
    blocks = param.view(-1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    blocks.copy_((blocks / scale).round() * scale)


def _reverse_q_head(model: Any, block: int) -> None:
    q = model.model.layers[block].self_attn.q_proj.weight
    width = model.config.head_dim if getattr(model.config, "head_dim", None) else q.shape[1] // q.shape[0]
    q[:width] = q[:width].flip(0)


def _unpermuted_k_head(model: Any, block: int) -> None:
    """llama.cpp's rotary permutation of one k head left undone (a conversion error)."""
    k = model.model.layers[block].self_attn.k_proj.weight
    width = model.config.head_dim
    k[:width] = k[:width].clone().view(2, width // 2, -1).transpose(0, 1).reshape(width, -1)


CHANGES: dict[str, Callable[[Any], None]] = {
    "bfloat16 rounding (every weight)": lambda m: [p.copy_(p.bfloat16().float()) for p in m.parameters()],
    "Q8_0-style rounding (every 2-D weight)": lambda m: [_q8_0(p) for p in m.parameters() if p.ndim == 2],
    "one q head reversed (block 10)": lambda m: _reverse_q_head(m, 10),
    "one q head reversed (block 25)": lambda m: _reverse_q_head(m, 25),
    "one k head's rotary pairs unpermuted (block 10)": lambda m: _unpermuted_k_head(m, 10),
    "block 15's input norm x0.8": lambda m: m.model.layers[15].input_layernorm.weight.mul_(0.8),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--near-tie", type=float, default=None, help="default: NEAR_TIE['bfloat16']")
    args = parser.parse_args()
    from layerprune.core.settings import RunSettings
    from layerprune.models.loading import load_model, resolve_model
    from layerprune.models.verification import NEAR_TIE, reference, teacher_forced_logits, transformers_verdict

    loaded = load_model(resolve_model(args.model, RunSettings(dtype="float32")), RunSettings(dtype="float32"))
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    expected = reference(model, tokenizer)
    threshold = NEAR_TIE["bfloat16"] if args.near_tie is None else args.near_tie
    margins = expected.margins()
    print(json.dumps({"positions": sum(len(m) for m in margins), "near_tie": threshold,
                      "margin_quantiles_5_10_25_50": [round(v, 3) for v in torch.cat(margins).quantile(
                          torch.tensor([0.05, 0.1, 0.25, 0.5])).tolist()]}), flush=True)
    for name, change in CHANGES.items():
        changed = copy.deepcopy(model)
        with torch.no_grad():
            change(changed)
        result = transformers_verdict(changed, tokenizer, expected, threshold)
        found = [row.argmax(-1) for row in teacher_forced_logits(changed, expected.sequences)]
        flips = sorted(round(m[i].item(), 3) for m, f, e in zip(margins, found, expected.top1, strict=True)
                       for i in range(len(e)) if f[i].item() != e[i])
        print(json.dumps({"change": name, "verdict": result["verdict"], "top1_agreement": result["top1_agreement"],
                          "max_abs_logit_diff": result["max_abs_logit_diff"], "flipped_margins": flips,
                          "continuations_equal": result["continuations"]["equal"]}), flush=True)


if __name__ == "__main__":
    main()
