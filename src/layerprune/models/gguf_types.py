"""What `layerprune export --gguf --outtype TYPE` writes each tensor as, and how many bytes that takes.

The types the gguf package encodes itself (f32, f16, bf16, q8_0): 1-D tensors (norms, biases) are F32; a 2-D tensor
is in the type when the type's block divides its rows, else F16. One rule for the writer (export/writer.py) and for a
`prune --target memory=... --outtype TYPE` plan, so the plan counts the bytes the export will write. The k-quants are
llama.cpp's choice tensor by tensor (fallback types where 256 does not divide a row: SmolLM2's "Q4_K_M" is mostly
Q5_0), so llama.cpp's quantizer prices them itself (models/kquant_price.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # encoded by the gguf package; the k-quants by llama.cpp's quantizer
K_QUANTS = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q2_k_s", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
            "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")  # llama.cpp's quantizer, no importance matrix needed
# the width of the zero FFN the `deci` export writes for a block whose MLP is removed and attention kept
# (export/deci.py: llama.cpp's deci graph drops such a block's attention at feed-forward length 0): a multiple of
# every quantizer's block, so it encodes as the other FFNs do
ZERO_FFN = 256


_NAMES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"),
          "q8_0": ("Q8_0", "MOSTLY_Q8_0")}  # outtype -> its 2-D tensors' GGML type and the file type it declares


def qtype(outtype: str) -> Any:
    """The GGML type of an outtype's 2-D tensors."""
    import gguf

    return gguf.GGMLQuantizationType[_NAMES[outtype][0]]


def file_type(outtype: str) -> Any:
    """The llama.cpp file type a GGUF written at `outtype` declares."""
    import gguf

    return gguf.LlamaFileType[_NAMES[outtype][1]]


def written_type(shape: Sequence[int], wanted: Any) -> Any:
    """The type a tensor of `shape` is written as when `wanted` is asked: F32 for 1-D tensors, F16 for rows the
    type's block does not divide, else `wanted`."""
    import gguf

    if len(shape) <= 1 or wanted == gguf.GGMLQuantizationType.F32:
        return gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    return wanted if shape[-1] % block == 0 else gguf.GGMLQuantizationType.F16


def written_bytes(shape: Sequence[int], outtype: str) -> int:
    """The bytes of a tensor of `shape` in a GGUF written at `outtype` (its data, without alignment padding)."""
    import gguf

    used = written_type(shape, qtype(outtype))
    block, size = gguf.GGML_QUANT_SIZES[used]
    return math.prod(shape) // block * size


def zero_ffn_bytes(hidden: int, outtype: str) -> int:
    """What the `deci` export writes at `outtype` for one block whose MLP alone is removed: the zero FFN's gate, up
    and down projections and its norm."""
    return (2 * written_bytes((ZERO_FFN, hidden), outtype) + written_bytes((hidden, ZERO_FFN), outtype)
            + written_bytes((hidden,), outtype))
