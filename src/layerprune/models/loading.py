"""Resolve a model spec (hub id, local dir, .gguf, embedded) and load it for CPU or GPU work."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from layerprune.core.errors import LayerpruneError, one_line
from layerprune.core.outputs import atomic_output_dir, cache_lock
from layerprune.core.settings import RunSettings
from layerprune.models import embedded, nemotron_nas  # noqa: F401  (importing it registers the Nemotron-NAS layout)
from layerprune.models.gguf_once import parsed_once
from layerprune.models.gguf_source import SOURCE_FILE
from layerprune.models.hub import resolve_revision
from layerprune.models.identity import quick_digest
from layerprune.models.lineage import read_lineage
from layerprune.models.safetensors_check import check_model_dir_weights
from layerprune.models.surgery import checkpoint_dtype

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "electra", "camembert", "ernie", "roc_bert", "bert-generation",
                 "xlm-roberta-xl", "data2vec-text", "megatron-bert", "rembert", "xmod"}


@dataclass
class ModelSource:
    """Where a model comes from, and what identifies that exact version."""

    spec: str
    location: str
    kind: str  # embedded | gguf | local | hub
    identity: dict[str, Any] = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return self.kind != "hub"


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: ModelSource
    load_seconds: float = 0.0
    checkpoint_dtype: torch.dtype | None = None  # the dtype the weights are stored in (config, else tensors)


# "PREFIX:NAME" specs that a layer above resolves: `variant:NAME` (a post-trained model, made once: layerprune.posttrain
# registers it on import, as the CLI and the studies do)
SPEC_PREFIXES: dict[str, Callable[[str, str, RunSettings], ModelSource]] = {}
PLANNING: ContextVar[bool] = ContextVar("planning", default=False)


@contextmanager
def planning() -> Iterator[None]:
    """A dry run: specs resolve without making anything (a variant not yet made plans on its source model)."""
    token = PLANNING.set(True)
    try:
        yield
    finally:
        PLANNING.reset(token)


def resolve_model(spec: str | os.PathLike[str] | None, settings: RunSettings | None = None) -> ModelSource:
    """Turn what the user typed into a loadable location (converting GGUF once, into the cache)."""
    settings = settings or RunSettings()
    text = None if spec is None else str(spec)
    name = embedded.embedded_name(text)
    if name is not None:
        return _resolve_embedded(name, text or "embedded", settings)
    prefix, colon, rest = (text or "").partition(":")
    if colon and prefix == "variant":
        if prefix not in SPEC_PREFIXES:
            raise LayerpruneError(f"{text}: variant specs are made by layerprune.posttrain; import it first (the "
                                  "layerprune commands do)")
        return SPEC_PREFIXES[prefix](rest, text or "", settings)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise LayerpruneError(f"model file not found: {text}")
        return _resolve_gguf(path, text, settings)
    if path.is_dir():
        return _resolve_local(path, text, settings)
    if path.exists():
        raise LayerpruneError(f"{text} is a file, not a model directory or a .gguf file")
    if HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        return ModelSource(text, text, "hub", {"hub_id": text})
    raise LayerpruneError(f"model path not found: {text}")


def _resolve_local(path: Path, spec: str, settings: RunSettings) -> ModelSource:
    config = path / "config.json"
    if not config.is_file():
        raise LayerpruneError(f"{spec} is not a model directory (no config.json)")
    check_model_dir_weights(path, settings.allow_pickle)
    identity = {"path": str(path.resolve())}
    lineage = read_lineage(path)
    if lineage is not None:
        identity["pruned_from"] = lineage.source.model_dump(mode="json")
    return ModelSource(spec, str(path), "local", identity)


def _resolve_gguf(path: Path, spec: str, settings: RunSettings, label: str | None = None) -> ModelSource:
    digest = quick_digest(path, limit=64 << 20)
    cache = settings.resolved_cache_dir()
    target = cache / "converted" / f"{label or path.stem}-{digest[:16]}"
    if not (target / "config.json").is_file():
        with cache_lock(cache, f"converted-{target.name}"):
            if not (target / "config.json").is_file():  # another process may have made it while this one waited
                convert_gguf(path, target)
    return ModelSource(spec, str(target), "gguf", {"gguf_file": path.name, "gguf_sha256_64m": digest})


def _resolve_embedded(name: str, spec: str, settings: RunSettings) -> ModelSource:
    model = embedded.EMBEDDED_MODELS[name]
    path = embedded.gguf_path(model, settings.resolved_cache_dir())
    source = _resolve_gguf(path, spec, settings, label=name)
    source.kind = "embedded"
    source.identity["embedded"] = name
    return source


def convert_gguf(path: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint once and cache it as safetensors (a load then takes seconds)."""
    log.warning("converting %s to safetensors in %s (once; later loads use the cache)", path.name, target)
    try:
        with parsed_once():  # transformers would parse the file's metadata once for each of the three
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for unreadable files
        raise LayerpruneError(f"could not read GGUF file {path}: {one_line(exc)}") from exc
    clear_gguf_quantizer(model)
    with atomic_output_dir(target, overwrite=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(path)}, indent=2))


def clear_gguf_quantizer(model: PreTrainedModel) -> None:
    """A dequantized GGUF model keeps its quantizer state and refuses to save; drop it."""
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    text = model.config.get_text_config()
    for config in {id(model.config): model.config, id(text): text}.values():
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config._name_or_path = ""


def device_map_kwargs(settings: RunSettings, whole: bool = False) -> dict[str, Any]:
    """`from_pretrained` keywords that place the model: --device-map and --max-memory (accelerate spreads the blocks
    over the devices), none without --device-map; `whole`: all of it on --device (a 4-bit QLoRA base)."""
    if whole:
        return {"device_map": {"": settings.resolved_device()}}
    if not settings.device_map:
        return {}
    return {"device_map": settings.device_map, "max_memory": settings.resolved_max_memory()}


def check_loading_info(spec: str, info: dict[str, Any]) -> None:
    """Refuse weights the checkpoint lacks for its config (transformers would start them at random and go on), say
    which it holds that the config has no place for."""
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" and {len(missing) - 2} more" if len(missing) > 2 else ""
        raise LayerpruneError(f"could not load model {spec}: its checkpoint lacks {len(missing)} weights its config "
                              f"needs ({', '.join(missing[:2])}{more}); a truncated checkpoint, or a config that "
                              "does not match it (num_hidden_layers?)")
    unexpected = sorted(info.get("unexpected_keys") or [])
    if unexpected:
        log.warning("model %s: %d weights of its checkpoint are not used by its config (%s ...)", spec,
                    len(unexpected), unexpected[0])


def load_model(
    spec: str | os.PathLike[str] | ModelSource | None = None,
    settings: RunSettings | None = None,
    **kwargs: Any,
) -> LoadedModel:
    """Load a decoder-only causal LM and its tokenizer; refuse anything else with one line."""
    settings = settings or RunSettings()
    source = spec if isinstance(spec, ModelSource) else resolve_model(spec, settings)
    start = time.perf_counter()
    revision = resolve_revision(source)  # a hub model: the commit its results are keyed on is the one loaded
    if revision:
        kwargs.setdefault("revision", revision)
    config = _load_config(source, settings, revision)
    check_decoder_only(config, source.spec)
    stored = checkpoint_dtype(config, Path(source.location) if source.is_local else None)
    tokenizer = load_tokenizer(source, settings)
    if "device_map" not in kwargs:
        kwargs.update(device_map_kwargs(settings))
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source.location,
            config=config,
            dtype=settings.resolved_dtype(),
            trust_remote_code=settings.trust_remote_code,
            use_safetensors=None if settings.allow_pickle else True,
            output_loading_info=True,
            **kwargs,
        )
    except LayerpruneError:
        raise
    except Exception as exc:
        raise LayerpruneError(f"could not load model {source.spec}: {one_line(exc)[:300]}") from exc
    check_loading_info(source.spec, info)
    if getattr(model, "hf_device_map", None) is None:
        model.to(settings.resolved_device())
    model.eval()
    if source.kind == "hub" and not source.identity.get("revision"):
        source.identity["revision"] = getattr(model.config, "_commit_hash", None)
    return LoadedModel(model, tokenizer, source, time.perf_counter() - start, stored)


def _load_config(source: ModelSource, settings: RunSettings, revision: str | None = None) -> Any:
    try:
        extra = {"revision": revision} if revision else {}
        return AutoConfig.from_pretrained(source.location, trust_remote_code=settings.trust_remote_code, **extra)
    except Exception as exc:
        where = "the Hugging Face hub" if source.kind == "hub" else source.location
        raise LayerpruneError(
            f"could not read the config of {source.spec} from {where}: {one_line(exc)[:200]}"
        ) from exc


def load_tokenizer(source: ModelSource, settings: RunSettings | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a model directory without tokenizer files is an error."""
    settings = settings or RunSettings()
    if source.is_local and not _has_tokenizer_files(Path(source.location)):
        raise LayerpruneError(f"{source.spec} has no tokenizer files (tokenizer.json or tokenizer.model)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.location, trust_remote_code=settings.trust_remote_code)
    except Exception as exc:
        raise LayerpruneError(f"could not load the tokenizer of {source.spec}: {one_line(exc)[:200]}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _has_tokenizer_files(path: Path) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
    return any((path / name).is_file() for name in names)


def check_decoder_only(config: Any, spec: str) -> None:
    """Refuse encoder-decoder and encoder-only models, and types with no causal-LM class."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        raise LayerpruneError(
            f"{spec} is an encoder-decoder model ({model_type}); layerprune needs a decoder-only causal LM"
        )
    if model_type in ENCODER_TYPES or (
        config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "auto_map", None)
    ):
        raise LayerpruneError(f"{spec} is not a decoder-only causal LM (model type '{model_type}')")


def copy_tokenizer_files(source: ModelSource, target: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Save the tokenizer (with its chat template) next to a derived model."""
    tokenizer.save_pretrained(target)
    if source.is_local:
        for name in ("chat_template.jinja", "chat_template.json"):
            src = Path(source.location) / name
            if src.is_file() and not (target / name).exists():
                shutil.copy2(src, target / name)
