"""The Nemotron-NAS (DeciLM) layout: decoder blocks whose attention or FFN may be absent.

The configuration and modeling files here are self-contained (torch and transformers only): a saved model carries
copies of them (`write_layout_files`), named in its config's `auto_map`, so plain transformers loads it with
`trust_remote_code=True` as it loads NVIDIA's published Nemotron-NAS models. Importing this package registers the
classes with transformers' Auto classes, so layerprune reads such checkpoints without remote code, and any
`save_pretrained` of such a model writes the files and the `auto_map` beside its weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from layerprune.models.nemotron_nas.configuration_decilm import (
    BlockConfig,
    DeciLMConfig,
    ffn_mult_to_intermediate_size,
)
from layerprune.models.nemotron_nas.modeling_decilm import DeciLMForCausalLM

MODEL_TYPE = "nemotron-nas"
ARCHITECTURE = "DeciLMForCausalLM"
LAYOUT_FILES = ("configuration_decilm.py", "modeling_decilm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_decilm.DeciLMConfig",
    "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM",
}


def register() -> None:
    """Let AutoConfig and AutoModelForCausalLM build the layout from `model_type: nemotron-nas` (idempotent), and
    let every save_pretrained of such a model (a recovered one too) copy the modeling files and write `auto_map`."""
    AutoConfig.register(MODEL_TYPE, DeciLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(DeciLMConfig, DeciLMForCausalLM, exist_ok=True)
    DeciLMConfig.register_for_auto_class()
    DeciLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")


def write_layout_files(directory: Path) -> None:
    """Copy the modeling files beside `directory`'s config.json and name them in its `auto_map`."""
    for name in LAYOUT_FILES:
        shutil.copyfile(Path(__file__).with_name(name), directory / name)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(auto_map=AUTO_MAP, architectures=[ARCHITECTURE], model_type=MODEL_TYPE)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def carries_our_layout(directory: Path) -> bool:
    """Whether `directory` is a Nemotron-NAS folder whose modeling files are layerprune's own, byte for byte (an
    engine that must run the folder's configuration code, vLLM, may then be told to trust it)."""
    try:
        config = json.loads((directory / "config.json").read_text())
        return config.get("model_type") == MODEL_TYPE and all(
            (directory / name).read_bytes() == Path(__file__).with_name(name).read_bytes() for name in LAYOUT_FILES)
    except (OSError, ValueError):
        return False


register()

__all__ = [
    "ARCHITECTURE",
    "AUTO_MAP",
    "LAYOUT_FILES",
    "MODEL_TYPE",
    "BlockConfig",
    "carries_our_layout",
    "DeciLMConfig",
    "DeciLMForCausalLM",
    "ffn_mult_to_intermediate_size",
    "register",
    "write_layout_files",
]
