"""`layerprune export --gguf`: one GGUF file from a pruned or recovered model directory, then read back.

The file is written beside its final name and renamed only once it is whole; the read-back (transformers' GGUF
loader: config fields, tokenizer ids, logits) is recorded in a JSON report next to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoConfig, AutoTokenizer

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import current_umask, write_atomic
from layerprune.core.settings import RunSettings
from layerprune.export.catalog import TRANSFORMERS_READS, family_for
from layerprune.export.quantize import QUANTS, check_quant_name, check_quantized, quantize_in_place, require_quantizer
from layerprune.export.tokenizer import copy_tokenizer, source_gguf
from layerprune.export.writer import add_tensors
from layerprune.models.gguf_once import fast_reader, parsed_once
from layerprune.models.gguf_types import OUTTYPES, file_type


class ExportReport(BaseModel):
    """What `export --gguf` wrote and how it was checked."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The model directory that was exported")
    output: str = Field(description="The .gguf file")
    outtype: str = Field(description="Weight encoding of the 2-D tensors (1-D tensors are F32)")
    architecture: str = Field(description="llama.cpp's architecture name")
    tensors: int
    bytes: int
    tokenizer_from: str = Field(description="The GGUF whose tokenizer fields were carried")
    per_layer: dict[str, Any] = Field(description="Per-layer metadata written (head counts, sliding-window pattern)")
    seconds: float
    readback: dict[str, Any] | None = Field(
        None, description="transformers' GGUF loader against the model directory (logits), or for architectures it "
                          "does not read (deci) the file's tensors decoded against the directory's; for a type "
                          "llama.cpp's quantizer made, llama.cpp's logits against transformers'")
    quantized: dict[str, Any] | None = Field(
        None, description="llama.cpp's quantizer: the file type and the tensor types it chose (a k-quant falls back "
                          "to another type where a row is not a multiple of 256)")


def export_gguf(model_dir: Path, output: Path, outtype: str = "q8_0", overwrite: bool = False,
                verify: bool = True, settings: RunSettings | None = None) -> ExportReport:
    """Write `model_dir` as `output` (.gguf) in `outtype`; refuse unknown families and outtypes in one line.

    A type of llama.cpp's quantizer (q4_k_m, q6_k, ...) is made from the F16 file and, with `verify`, run by
    llama.cpp against transformers before it takes its name (export/quantize.py)."""
    model_dir, output, outtype = Path(model_dir), Path(output), outtype.lower()
    check_quant_name(outtype, tuple(OUTTYPES))
    if outtype in QUANTS:
        require_quantizer(outtype)
    config = _config(model_dir)
    family = family_for(config)
    if output.suffix != ".gguf":
        raise LayerpruneError(f"the GGUF output must end in .gguf: {output}")
    if output.exists() and not overwrite:
        raise LayerpruneError(f"{output} already exists; pass --overwrite")
    tokenizer_gguf = source_gguf(model_dir, settings)
    if output.resolve() == Path(tokenizer_gguf).resolve():
        raise LayerpruneError(f"{output} is the GGUF the tokenizer is read from (the model's source); choose another "
                              "output")
    start = time.perf_counter()
    quantized, checked = None, None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # once: Gemma-3's 262k-token tokenizer takes seconds to load
    with _atomic_file(output) as tmp:
        tensors = _write(tmp, model_dir, family, config, "f16" if outtype in QUANTS else outtype, tokenizer_gguf,
                         tokenizer)
        if outtype in QUANTS:
            quantized = quantize_in_place(tmp, outtype)
            checked = check_quantized(tmp, model_dir, outtype) if verify else None
    with parsed_once():  # the per-layer fields and the read-back's three loads: one parse of the file
        report = ExportReport(model=str(model_dir.resolve()), output=str(output), outtype=outtype,
                              architecture=family.arch.name, tensors=tensors, bytes=output.stat().st_size,
                              tokenizer_from=str(tokenizer_gguf), per_layer=per_layer_fields(output),
                              seconds=round(time.perf_counter() - start, 1), quantized=quantized)
        if verify:
            report.readback = checked or _read_back(model_dir, output, family, config, tokenizer)
    write_atomic(output.with_suffix(".export.json"), report.model_dump_json(indent=2))
    return report


def _read_back(model_dir: Path, output: Path, family: Any, config: Any, tokenizer: Any) -> dict[str, Any]:
    """transformers' GGUF loader where it reads the architecture (logits); else the file's tensors, decoded."""
    if family.arch in TRANSFORMERS_READS:
        from layerprune.export.readback import read_back

        return read_back(model_dir, output, tokenizer)
    from layerprune.export.readback_weights import read_back_weights

    return read_back_weights(model_dir, output, family, config)


def _config(model_dir: Path) -> Any:
    if not (model_dir / "config.json").is_file():
        raise LayerpruneError(f"{model_dir} is not a model directory (no config.json)")
    return AutoConfig.from_pretrained(model_dir)


def _write(path: Path, model_dir: Path, family: Any, config: Any, outtype: str, tokenizer_gguf: Path,
           tokenizer: Any) -> int:
    arch = gguf.MODEL_ARCH_NAMES[family.arch]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model_dir.resolve().name)
    writer.add_file_type(file_type(outtype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    family.metadata(writer, config)
    template = getattr(tokenizer, "chat_template", None)
    copy_tokenizer(writer, tokenizer_gguf, template if isinstance(template, str) else None)
    tensors = add_tensors(writer, model_dir, family, config, outtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@contextlib.contextmanager
def _atomic_file(path: Path):  # type: ignore[no-untyped-def]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as exc:
        raise LayerpruneError(f"cannot write {path}: {exc.strerror or exc} ({exc.filename or path})") from exc
    os.close(fd)
    try:
        yield Path(name)
        os.chmod(name, 0o666 & ~current_umask())  # mkstemp's file is private: the user's usual permissions
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def per_layer_fields(path: Path) -> dict[str, Any]:
    """The per-layer fields as written: head counts, feed-forward lengths, the sliding-window pattern (scalars when
    uniform)."""
    reader = fast_reader(path)
    arch = reader.fields["general.architecture"].contents()
    wanted = ("attention.head_count", "attention.head_count_kv", "feed_forward_length", "attention.sliding_window",
              "attention.sliding_window_pattern", "block_count")
    found = {key: reader.fields.get(f"{arch}.{key}") for key in wanted}
    return {key: _plain(field.contents()) for key, field in found.items() if field is not None}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
