"""One fast parse of a GGUF file for transformers' config, tokenizer and weights, and for our own readers.

transformers' GGUF loader (`load_gguf_checkpoint`) builds a new `gguf.GGUFReader` for each of AutoConfig,
AutoTokenizer and AutoModelForCausalLM, and the reader parses every metadata field in Python, one memmap slice per
array element and per string length: for Gemma-3's 262,144-token vocabulary that is 2.4 million field parts, 12 s a
parse on one core, three times per load. `fast_reader` is gguf's reader with one-level arrays of scalars and of
strings read from a plain view of the file (the same fields, parts, dtypes and data indexes; 0.5 s for Gemma-3;
nested arrays and byte-swapped files go through gguf's own code). Inside `parsed_once()` a file opened again is the
reader already made and transformers' metadata-only load parses the values once, so a conversion or a read-back
parses each file once.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_OPEN: list[dict[tuple[str, str], Any]] = []  # the readers of each parsed_once() block open in this process


def fast_reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
    """A GGUF file's reader (a gguf.GGUFReader); inside parsed_once(), the one already made for (file, mode)."""
    if not _OPEN:
        return _reader_class()(path, mode)
    key = (os.path.realpath(path), mode)
    if key not in _OPEN[-1]:
        _OPEN[-1][key] = _reader_class()(path, mode)
    return _OPEN[-1][key]


@functools.cache
def _reader_class() -> type:
    import numpy as np
    from gguf import GGUFValueType
    from gguf.gguf_reader import GGUFReader  # the class itself (parsed_once replaces the package's name)

    one_level = {int(t) for t in GGUFReader.gguf_scalar_to_np} | {int(GGUFValueType.STRING)}

    class FastReader(GGUFReader):
        """gguf.GGUFReader whose one-level arrays are parsed from a plain ndarray view (no memmap bookkeeping per
        part)."""

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            count, offs = int(alen[0]), orig_offs + 12
            if count == 0 or raw_itype[0] not in one_level:
                return super()._get_field_parts(orig_offs, raw_type)  # empty arrays, arrays of arrays
            itype = GGUFValueType(raw_itype[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            types = [GGUFValueType.ARRAY, itype]
            plain = self.data.view(np.ndarray)
            if nptype is not None:
                size = np.dtype(nptype).itemsize
                values = plain[offs:offs + size * count].view(nptype)
                parts = [raw_itype, alen, *(values[i:i + 1] for i in range(count))]
                return 12 + size * count, parts, list(range(2, 2 + count)), types
            parts, view = [raw_itype, alen], memoryview(plain)
            for _ in range(count):
                length = int.from_bytes(view[offs:offs + 8], sys.byteorder)  # the file's order is the host's
                parts += (plain[offs:offs + 8].view(np.uint64), plain[offs + 8:offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(3, 3 + 2 * count, 2)), types

    return FastReader


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` and `fast_reader(path)` return one fast reader per (file, mode),
    and transformers' metadata-only `load_gguf_checkpoint` (AutoConfig's and AutoTokenizer's) parses a file's values
    once (a copy each call)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    original, original_load = gguf.GGUFReader, loader.load_gguf_checkpoint
    metadata: dict[str, Any] = {}

    def load(path: Any, return_tensors: bool = False, model_to_load: Any = None, **kwargs: Any) -> Any:
        if return_tensors or model_to_load is not None or kwargs:
            return original_load(path, return_tensors=return_tensors, model_to_load=model_to_load, **kwargs)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = original_load(path, return_tensors=False)
        return copy.deepcopy(metadata[key])

    _OPEN.append({})
    gguf.GGUFReader = fast_reader  # transformers imports it from `gguf` at each call (modeling_gguf_pytorch_utils)
    loader.load_gguf_checkpoint = load  # and this from its module at each call
    try:
        yield
    finally:
        gguf.GGUFReader, loader.load_gguf_checkpoint = original, original_load
        _OPEN.pop()
