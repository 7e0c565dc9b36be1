"""`export --outtype q4_k_m` (and every type llama.cpp's quantizer makes without an importance matrix): the F16 GGUF
this package writes, quantized by llama.cpp itself (llama-cpp-python's `llama_model_quantize`), then run by
llama.cpp on the verification prompts against transformers before it takes its final name.

The check is the mean KL divergence of llama.cpp's next-token distribution from transformers' over every prompt
position, bounded per type; the verdict of models/verification.compare (top-1 up to near-ties over prompt + greedy
continuation, largest logit error) is reported beside it, not gated: a 4-bit type's rounding flips decisive tokens.
The bounds are loose on purpose: they catch a broken file, not a lossy one (bench/bench_quantized_export.py,
SmolLM2-135M: F16 0.00001 nats; Q6_K 0.03 and Q4_K_M 0.09 unpruned, 0.12 and 0.42 with 7 sublayers removed; Q2_K
0.56; a file missing 4 blocks 1.29). A k-quant needs rows that are multiples of 256: llama.cpp gives a narrower
tensor a fallback type (SmolLM2's 576-wide rows get Q5_0 in Q4_K_M), and the report counts the types it chose.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import torch

from layerprune.core.errors import LayerpruneError
from layerprune.core.extras import require_extra
from layerprune.models.gguf_once import fast_reader
from layerprune.models.gguf_types import K_QUANTS

QUANTS: dict[str, gguf.LlamaFileType] = {name: gguf.LlamaFileType[f"MOSTLY_{name.upper()}"]
                                         for name in K_QUANTS}  # the IQ1-IQ3 types need an importance matrix
TOLERANCE: dict[str, float] = {  # mean KL, nats
    "q6_k": 0.3, "q5_k_m": 0.6, "q5_k_s": 0.6, "q5_0": 0.6, "q5_1": 0.6, "q4_k_m": 0.6, "q4_k_s": 0.6,
    "iq4_nl": 0.6, "iq4_xs": 0.6, "q4_0": 1.2, "q4_1": 1.2, "q3_k_l": 1.2, "q3_k_m": 1.2, "q3_k_s": 1.2,
    "q2_k": 2.0, "q2_k_s": 2.0}


def check_quant_name(name: str, known: tuple[str, ...]) -> None:
    """One line for a type neither this package's writer nor llama.cpp's quantizer makes, with the close ones."""
    if name in known or name in QUANTS:
        return
    choices = (*known, *QUANTS)
    close = difflib.get_close_matches(name, choices, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise LayerpruneError(f"unknown GGUF type '{name}'; {hint}choose one of {', '.join(choices)}")


def require_quantizer(name: str) -> None:
    """One line naming the extra when llama-cpp-python is not installed."""
    require_extra("gguf-run", f"export --outtype {name} (llama.cpp's quantizer)")


def quantize_in_place(path: Path, name: str, threads: int = 0) -> dict[str, Any]:
    """Replace the F16 GGUF at `path` with its `name` quantization; its file type and the tensor types chosen."""
    import llama_cpp  # type: ignore[import-not-found]

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = int(QUANTS[name]), threads
    fd, out = tempfile.mkstemp(prefix=f".{path.name}.{name}-", dir=path.parent)
    os.close(fd)
    try:
        with _quiet_llama():
            failed = llama_cpp.llama_model_quantize(str(path).encode(), out.encode(), params)
        if failed:
            raise LayerpruneError(f"llama.cpp's quantizer could not make {name} of {path.name} (its log says why)")
        os.replace(out, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out)
    reader = fast_reader(path)
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return {"file_type": gguf.LlamaFileType(int(reader.fields["general.file_type"].contents())).name,
            "tensor_types": dict(sorted(types.items()))}


@contextlib.contextmanager
def _quiet_llama():  # type: ignore[no-untyped-def]
    """llama.cpp's per-tensor log lines off, its errors on."""
    logger = logging.getLogger("llama-cpp-python")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_quantized(path: Path, model_dir: Path, name: str) -> dict[str, Any]:
    """`logit_agreement`, and one line when it is past the type's tolerance (or llama.cpp cannot load the file)."""
    result = {**logit_agreement(path, model_dir), "tolerance": TOLERANCE[name]}
    if not result["mean_kl"] <= TOLERANCE[name]:
        raise LayerpruneError(f"export --outtype {name}: llama.cpp's next-token distribution on the quantized file "
                              f"is {result['mean_kl']:.3f} nats (mean KL) off transformers', past {name}'s "
                              f"{TOLERANCE[name]}; nothing written (--no-verify keeps it)")
    return result


def logit_agreement(path: Path, model_dir: Path) -> dict[str, Any]:
    """llama.cpp on the GGUF against transformers on the directory (float32): mean KL(transformers || llama.cpp) in
    nats at every prompt position of the verification prompts, and models/verification.compare's verdict at every
    position of prompt + transformers' continuation (teacher-forced; top-1 up to near-ties, largest logit error)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerprune.export.readback import file_encoding
    from layerprune.models.verification import compare, max_abs_error, near_tie_for, reference

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = reference(model, AutoTokenizer.from_pretrained(model_dir))
    found = llama_cpp_logits(path, expected.sequences)
    prompts = [(e[: len(ids)], f[: len(ids)]) for e, f, ids in zip(expected.logits, found, expected.prompt_ids,
                                                                      strict=True)]
    kl = sum(_kl(e, f).sum().item() for e, f in prompts) / sum(len(ids) for ids in expected.prompt_ids)
    verdict = compare(expected, [row.argmax(-1).tolist() for row in found], None,
                      {"max_abs_logit_diff": max_abs_error(expected.logits, found)}, near_tie_for(file_encoding(path)))
    return {"runner": "llama.cpp", "mean_kl": round(kl, 5), **verdict}


def _kl(expected: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """KL(transformers || llama.cpp) of the next-token distributions, per position; a one-line error when the two
    vocabularies differ in width."""
    if expected.shape[-1] != found.shape[-1]:
        raise LayerpruneError(f"export: llama.cpp's logits are {found.shape[-1]} wide, transformers' "
                              f"{expected.shape[-1]} (the GGUF's vocabulary is not the model's); the quantized file "
                              "cannot be checked; nothing written (--no-verify keeps it)")
    log_p, log_q = expected.log_softmax(-1), found.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def llama_cpp_logits(path: Path, prompt_ids: list[list[int]]) -> list[torch.Tensor]:
    """llama.cpp's logits at every position of each sequence (token ids), as float32 tensors."""
    from llama_cpp import Llama  # type: ignore[import-not-found]

    try:
        llm = Llama(model_path=str(path), n_ctx=max(map(len, prompt_ids)) + 8, logits_all=True, verbose=False,
                    seed=0, n_threads=1)
    except ValueError as exc:  # llama-cpp-python's "Failed to load model from file"
        raise LayerpruneError(f"llama.cpp cannot load the quantized {path.name}: {exc}") from exc
    rows = []
    try:
        for ids in prompt_ids:
            llm.reset()
            llm.eval(ids)
            rows.append(torch.tensor(llm.scores[: len(ids)]).float())
    finally:
        llm.close()
    return rows
