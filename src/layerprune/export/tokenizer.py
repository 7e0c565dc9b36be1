"""The tokenizer of an exported GGUF: llama.cpp's own fields, carried from the GGUF the model was first read from.

A model that came from a GGUF (the embedded models, a .gguf spec) has the exact tokenizer llama.cpp expects in that
file (vocabulary, merges or scores, token types, pre-tokenizer, special ids); the chat template is the model
directory's own (a recovered model may have changed it). A post-trained variant (`layerprune variant`) keeps its
source model's tokenizer, so a model pruned from one is followed back to that source. A model without a GGUF source
is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models.gguf_once import fast_reader
from layerprune.models.gguf_source import converted_from, recorded_gguf
from layerprune.models.lineage import VARIANT_REPORT, read_lineage

RECOVER_REPORT = "recover_report.json"


def source_record(directory: Path) -> dict[str, Any] | None:
    """The original model a pruned (prune_report.json) or recovered (recover_report.json) directory came from."""
    lineage = read_lineage(directory)
    if lineage is not None:
        source = lineage.source.model_dump(mode="json")
        location = Path(source.get("location") or "")
        if source["kind"] == "local" and (location / VARIANT_REPORT).is_file() and location != directory:
            return variant_source(location)
        return source
    if (directory / VARIANT_REPORT).is_file():
        return variant_source(directory)
    report = directory / RECOVER_REPORT
    if report.is_file():
        student = Path(json.loads(report.read_text())["student"]["location"])
        return source_record(student) if student.is_dir() and student != directory else None
    converted = converted_from(directory)  # a GGUF converted by layerprune's loader
    return {"kind": "gguf", "spec": converted, "identity": {}} if converted is not None else None


def variant_source(directory: Path) -> dict[str, Any] | None:
    """The model a post-trained variant was made from, as a source record (its tokenizer is the variant's)."""
    report = json.loads((directory / VARIANT_REPORT).read_text())
    spec, identity = report.get("source_model"), report.get("source_identity") or {}
    if "embedded" in identity:
        return {"kind": "embedded", "spec": spec, "identity": identity}
    if "gguf_file" in identity:
        return {"kind": "gguf", "spec": spec, "identity": identity}
    parent = Path(spec or "").expanduser()
    return source_record(parent) if spec and parent.is_dir() and parent.resolve() != directory.resolve() else None


def source_gguf(directory: Path, settings: RunSettings | None = None) -> Path:
    """The GGUF file whose tokenizer the export carries, or one line saying why there is none."""
    record = source_record(directory) or {}
    kind = record.get("kind")
    found = recorded_gguf(kind, record.get("spec"), record.get("identity") or {},
                          (settings or RunSettings()).resolved_cache_dir())
    if found is not None:
        return found
    where = f"{kind} model {record.get('spec')}" if record else "a model with no recorded source"
    raise LayerpruneError(f"export --gguf carries the tokenizer from the model's source GGUF, and {directory} "
                          f"comes from {where}; prune a .gguf or embedded model, or convert with llama.cpp's "
                          "convert_hf_to_gguf.py")


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path, chat_template: str | None) -> int:
    """Copy every tokenizer.* field of `source` into `writer`; the model directory's chat template wins.
    Returns the vocabulary size."""
    reader = fast_reader(source)
    tokens = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(key, value, main, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            tokens = len(value)
    template = chat_template or _field_text(reader, "tokenizer.chat_template")
    if template:
        writer.add_chat_template(template)
    return tokens


def _field_text(reader: gguf.GGUFReader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else field.contents()
