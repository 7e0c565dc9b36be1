"""Write a model directory's safetensors as GGUF tensors: gguf's name map, its quantizers, F32 for 1-D tensors."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from layerprune.core.errors import LayerpruneError
from layerprune.export.families import Family
from layerprune.models.gguf_types import qtype, written_type


def checkpoint_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) over the directory's safetensors shards, one shard open at a time."""
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise LayerpruneError(f"{directory} has no .safetensors weights to export")
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def encode(data: np.ndarray, wanted: gguf.GGMLQuantizationType) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The tensor in `wanted`; 1-D tensors (norms) and rows a quantizer's block does not divide stay F32 / become F16
    (models/gguf_types.written_type: the rule a --target memory= plan counts by)."""
    used = written_type(data.shape, wanted)
    if used == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32), used
    return gguf.quants.quantize(data.astype(np.float32), used), used


def add_tensors(writer: gguf.GGUFWriter, directory: Path, family: Family, config: Any, outtype: str) -> int:
    """Map, fix and encode every tensor and the family's extra ones; returns how many were written. A tensor gguf
    cannot name is an error."""
    names = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    wanted = qtype(outtype)
    written = 0
    tied = getattr(config, "tie_word_embeddings", False)
    arrays = ((name, tensor.float().numpy()) for name, tensor in checkpoint_tensors(directory))
    for name, array in itertools.chain(arrays, family.extra(config)):
        if name == "lm_head.weight" and tied:
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise LayerpruneError(f"export --gguf: no llama.cpp name for tensor {name} ({family.arch.name})")
        encoded, used = encode(family.fix(name, array, config), wanted)
        writer.add_tensor(target, encoded, raw_dtype=used)
        written += 1
    return written
