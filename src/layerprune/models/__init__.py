"""Model loading (hub, local, GGUF, embedded) and decoder-block surgery."""

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
