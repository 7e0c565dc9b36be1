"""What `export --gguf --outtype q4_k_m` (any type of llama.cpp's quantizer) would write for a model minus some blocks,
priced by llama.cpp itself, for `prune --target memory=... --outtype q4_k_m`.

A k-quant's tensor types are llama.cpp's choice, tensor by tensor: fallbacks where 256 does not divide a row, more
bits for some attention and FFN tensors by their layer's position among the model's layers. So the price comes from
llama.cpp's quantizer, in two of its own steps on the GGUF the model was read from (embedded models, a .gguf spec):
the file is copied without the candidate's blocks (`only_copy` with `prune_layers`: the blocks renumbered, as the
saved model's export will be), then the copy is priced by a dry run (`dry_run` with `allow_requantize`: the types
chosen for each tensor's name, shape and layer, and the bytes they take; nothing quantized). Types depend on names
and shapes, not on the source's own types, so a Q4_1 source prices what the F16 export will quantize to (the
embedded SmolLM2 at Q4_K_M: 98.87 MiB unpruned and 91.95 MiB without 3 blocks, the written files' tensor bytes to the
0.01 MiB the dry run reports).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.extras import require_extra
from layerprune.models.gguf_once import fast_reader
from layerprune.models.gguf_source import converted_from, recorded_gguf

if TYPE_CHECKING:
    from layerprune.models.loading import ModelSource

SIZE = re.compile(r"quant size\s*=\s*([\d.]+) MiB")


class KQuantPricer:
    """Tensor bytes llama.cpp's quantizer writes at `outtype` for the model in `source` (a GGUF, checked by
    `kquant_source`) minus a set of blocks (memoized; candidate copies in `work`)."""

    def __init__(self, source: Path, outtype: str, work: Path) -> None:
        self.source, self.outtype, self.work = source, outtype, work
        self.prices: dict[tuple[int, ...], int] = {}

    def __call__(self, blocks: Sequence[int]) -> int:
        key = tuple(sorted(set(blocks)))
        if key not in self.prices:
            copy = self.source
            if key:
                copy = self.work / "candidate.gguf"
                _quantize(self.source, copy, None, prune=key, only_copy=True)
            self.prices[key] = _dry_run_bytes(copy, self.outtype, self.work)
        return self.prices[key]


def kquant_source(source: ModelSource, cache_dir: Path, outtype: str, depth: int) -> Path:
    """The GGUF a k-quant memory target is priced from, checked before any scoring: the model read from a GGUF (an
    embedded model's, a .gguf spec, a folder converted from one) with the model's own number of blocks, and
    llama-cpp-python installed with the quantizer's dry run. One line otherwise."""
    path = _source_gguf(source, cache_dir, outtype)
    require_extra("gguf-run", f"--outtype {outtype} for a memory target (priced by llama.cpp's quantizer)")
    import llama_cpp  # type: ignore[import-not-found]

    fields = dict(llama_cpp.llama_model_quantize_params._fields_)
    if "dry_run" not in fields or fields.get("prune_layers") is not ctypes.POINTER(ctypes.c_int32):
        raise LayerpruneError(f"--outtype {outtype} for a memory target needs llama.cpp's quantizer dry run and "
                              f"block pruning, which llama-cpp-python {llama_cpp.__version__} lacks: "
                              "pip install -U 'llama-cpp-python>=0.3.36'")
    blocks = _block_count(path)
    if blocks != depth:
        raise LayerpruneError(f"--outtype {outtype} prices the model from the GGUF it was read from, {path.name}, "
                              f"which has {blocks} blocks where the model has {depth}")
    return path


def _source_gguf(source: ModelSource, cache_dir: Path, outtype: str) -> Path:
    """The GGUF a model was read from, or one line saying a k-quant cannot be priced without one."""
    kind, spec = source.kind, source.spec
    found = recorded_gguf(kind, spec, source.identity, cache_dir)
    if found is None and kind == "local":  # a folder layerprune's loader converted from a GGUF
        found = recorded_gguf("gguf", converted_from(Path(source.location)), {}, cache_dir)
    if found is not None:
        return found
    raise LayerpruneError(f"--outtype {outtype} prices a memory target from the GGUF the model was read from, and "
                          f"{spec} ({kind}) was not read from one: prune a .gguf or embedded model, or count the "
                          "weights at f16 / q8_0, which are priced here")


def _block_count(path: Path) -> int:
    reader = fast_reader(path)
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.block_count"].contents())


def _dry_run_bytes(path: Path, outtype: str, work: Path) -> int:
    """The bytes llama.cpp's dry run says `path` takes at `outtype` (its "quant size", to 0.01 MiB)."""
    text = _quantize(path, work / "dry-run.gguf", outtype, dry_run=True)  # nothing is written there
    match = SIZE.search(text)
    if match is None:
        raise LayerpruneError(f"llama.cpp's dry run of {path.name} at {outtype} gave no size (its log: "
                              f"{_last_line(text)})")
    return round(float(match.group(1)) * 2**20)


def _quantize(source: Path, output: Path, outtype: str | None, prune: Sequence[int] = (), only_copy: bool = False,
              dry_run: bool = False) -> str:
    """One call of llama.cpp's quantizer (`outtype` None: a copy); its log (captured, not printed). A failure is one
    line."""
    import gguf
    import llama_cpp  # type: ignore[import-not-found]

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(gguf.LlamaFileType[f"MOSTLY_{(outtype or 'f16').upper()}"])
    params.nthread, params.only_copy, params.dry_run, params.allow_requantize = 1, only_copy, dry_run, True
    indices = (ctypes.c_int32 * (len(prune) + 1))(*prune, -1)  # llama.cpp reads the list up to -1
    if prune:
        params.prune_layers = ctypes.cast(indices, ctypes.POINTER(ctypes.c_int32))
    with _captured_log() as lines:
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(output).encode(), params)
    text = "".join(lines)
    if failed:
        raise LayerpruneError(f"llama.cpp's quantizer failed on {source.name} ({outtype or 'a copy'}, without blocks "
                              f"{list(prune)}): {_last_line(text)}")
    return text


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no log"])[-1]


@contextmanager
def _captured_log() -> Iterator[list[str]]:
    """llama.cpp's log lines into a list while the block runs; llama-cpp-python's own logger again after."""
    import llama_cpp  # type: ignore[import-not-found]
    from llama_cpp import _logger  # type: ignore[import-not-found]

    lines: list[str] = []

    @llama_cpp.llama_log_callback  # type: ignore[misc]
    def keep(level: int, text: bytes, user: Any) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    llama_cpp.llama_log_set(keep, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
