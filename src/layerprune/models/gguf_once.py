"""One parse of a GGUF file for transformers' config, tokenizer and weights.

transformers' GGUF loader (`load_gguf_checkpoint`) builds a new `gguf.GGUFReader` for each of AutoConfig,
AutoTokenizer and AutoModelForCausalLM, and the reader parses every metadata field in Python: for Gemma-3's
262,144-token vocabulary that is 2.4 million field parts, about 15 s a parse on one core, three times per load.
Inside `parsed_once()` a file opened again is the reader already made (the loader only reads it), so a conversion or
a read-back parses each file once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` returns one reader per (file, mode)."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it from `gguf` at each call (modeling_gguf_pytorch_utils)
    try:
        yield
    finally:
        gguf.GGUFReader = original
        readers.clear()
