"""Everything that runs a model: loading (hub, local, GGUF, embedded), decoder-block surgery, the block walker
(walker.py) and the one generator (generate.py)."""

from layerprune.models.blocks import DecoderStack, drop_blocks, find_decoder_stack, skipped_blocks
from layerprune.models.loading import LoadedModel, ModelSource, load_model, resolve_model

__all__ = [
    "DecoderStack",
    "LoadedModel",
    "ModelSource",
    "drop_blocks",
    "find_decoder_stack",
    "load_model",
    "resolve_model",
    "skipped_blocks",
]
