"""Write a pruned model in the checkpoint's dtype, and prove it loads as pruned before it is kept.

`verify_surgery` is the check every writer runs: the model class built from the new config (on the meta
device) has exactly the pruned weights' keys and shapes, and the written directory, reloaded, gives the
logits of the original model with the dropped blocks skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerprune.core.errors import LayerpruneError, one_line
from layerprune.models.blocks import find_decoder_stack
from layerprune.models.logits_check import WRITTEN_LOGITS_DIFFER, check_logits_agree, logits_rtol

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NO_SPACE = re.compile(r"no space left|os error 28|storagefull|errno 28", re.IGNORECASE)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_dtype(value: Any) -> torch.dtype | None:
    """A config's dtype entry (a string or torch.dtype) as a floating torch.dtype, or None."""
    if isinstance(value, torch.dtype):
        return value if value.is_floating_point else None
    return DTYPES.get(str(value).removeprefix("torch.")) if value else None


def checkpoint_dtype(config: Any, directory: Path | None = None) -> torch.dtype | None:
    """The dtype the checkpoint is stored in: its config's dtype, else its safetensors tensors' commonest."""
    for cfg in (config, config.get_text_config() if hasattr(config, "get_text_config") else config):
        for key in ("dtype", "torch_dtype"):
            found = as_dtype(getattr(cfg, key, None))
            if found is not None:
                return found
    return _safetensors_dtype(directory) if directory is not None else None


def _safetensors_dtype(directory: Path) -> torch.dtype | None:
    from layerprune.models.safetensors_check import open_safetensors

    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    counts: Counter[torch.dtype] = Counter()
    for path in sorted(directory.glob("*.safetensors"))[:1]:
        with open_safetensors(path) as handle:
            found = (handle.get_slice(name).get_dtype() for name in handle.keys())
            counts.update(names[dtype] for dtype in found if dtype in names)
    return counts.most_common(1)[0][0] if counts else None


def cast_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict with floating tensors in `dtype` (fp32-pinned modules kept), tied tensors still shared."""
    keep_fp32 = set(getattr(model, "_keep_in_fp32_modules", None) or []) | set(
        getattr(model, "_keep_in_fp32_modules_strict", None) or []
    )
    cast: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        target = torch.float32 if any(part in name.split(".") for part in keep_fp32) else dtype
        if tensor.is_floating_point() and tensor.dtype != target:
            key = (tensor.data_ptr(), tensor.shape, tensor.stride(), target)
            tensor = cast.setdefault(key, tensor.to(target))  # type: ignore[arg-type]
        out[name] = tensor
    return out


def saved_size(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes the weights take in `dtype` (tied tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * (
            torch.finfo(dtype).bits // 8 if tensor.is_floating_point() else tensor.element_size()
        )
    return total


def check_free_space(directory: Path, needed: int, label: Path | str) -> None:
    """Refuse to start a write the disk cannot hold (with 5% and 64 MB to spare)."""
    free = shutil.disk_usage(directory).free
    if free < needed * 1.05 + (64 << 20):
        raise LayerpruneError(f"not enough disk space for {label}: it needs about {_gb(needed)}, {_gb(free)} free")


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def write_pretrained(
    model: nn.Module, directory: Path, dtype: torch.dtype, max_shard_size: str, label: Path | str
) -> int:
    """save_pretrained in `dtype` (config's dtype set to match); a full disk is one line naming `label`."""
    needed = saved_size(model, dtype)
    check_free_space(directory, needed, label)
    state = None if dtype == next(model.parameters()).dtype else cast_state_dict(model, dtype)
    try:
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size, state_dict=state)
    except Exception as exc:
        if NO_SPACE.search(str(exc)) or getattr(exc, "errno", None) == 28:
            raise LayerpruneError(
                f"no space left on device while writing {label}: it needs about {_gb(needed)}; nothing was written"
            ) from exc
        raise
    _set_config_dtype(directory / "config.json", dtype_name(dtype))
    return needed


def _set_config_dtype(path: Path, name: str) -> None:
    config = json.loads(path.read_text())

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key in ("dtype", "torch_dtype"):
                if key in node:
                    node[key] = name
            for value in node.values():
                visit(value)

    config["dtype"] = name
    visit(config)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def skip_reference_logits(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, skip: Sequence[int]
) -> torch.Tensor:
    """Logits of the full model with each skipped block's output replaced by its input (no config changes)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    layers = find_decoder_stack(model).layers
    handles = [layers[index].register_forward_hook(hook, with_kwargs=True) for index in skip]
    try:
        with torch.inference_mode():
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    finally:
        for handle in handles:
            handle.remove()


def check_config_builds(model: nn.Module, build: Callable[[], nn.Module] | None = None) -> nn.Module:
    """The model class built from `model`'s (new) config on the meta device (or what `build` builds from it, e.g.
    the config as written, read back); one line when the family refuses it. Its weights are not initialised: on the
    meta device that only costs time, and a check of keys and shapes never reads them (tied weights are tied)."""
    from transformers.initialization import no_init_weights

    try:
        if build is not None:
            return build()
        with torch.device("meta"), no_init_weights():
            fresh = type(model)(model.config)
        fresh.tie_weights()  # else done by the initialisation
        return fresh
    except Exception as exc:  # the family's own checks of its config, in many exception types
        raise LayerpruneError(
            f"surgery check failed: the new config does not build a {type(model).__name__}: "
            f"{one_line(exc)[:300]}; nothing was written"
        ) from exc


def check_config_matches_weights(model: nn.Module, shapes: dict[str, tuple[int, ...]] | None = None,
                                 fresh: nn.Module | None = None) -> int:
    """Build the model class from its (new) config on the meta device: same state-dict keys and shapes.

    `shapes` (name -> shape) are the weights to be written; by default `model`'s own state dict (a streaming
    writer passes what it will write, and `model` may then live on the meta device). `fresh`: the model the
    caller has built from the new config (`check_config_builds`), else it is built here.
    """
    fresh = fresh if fresh is not None else check_config_builds(model)
    expected = {name: tuple(t.shape) for name, t in fresh.state_dict().items()}
    actual = shapes if shapes is not None else {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if shapes is not None:  # files hold a tied tensor once (e.g. lm_head.weight = embed_tokens.weight)
        expected = {
            name: shape for name, shape in expected.items() if name in actual or not _tied_to(fresh, name, actual)
        }
    missing, unexpected = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    shapes = sorted(name for name in set(expected) & set(actual) if expected[name] != actual[name])
    if missing or unexpected or shapes:
        raise LayerpruneError(
            f"surgery check failed: the new {type(model).__name__} config expects other weights than the pruned ones "
            f"(missing {_few(missing)}, unexpected {_few(unexpected)}, other shapes {_few(shapes)}); "
            "nothing was written"
        )
    return len(actual)


def _tied_to(model: nn.Module, name: str, present: dict[str, Any]) -> bool:
    """Whether `name` is the same parameter as another name that is present."""
    params = model.state_dict(keep_vars=True)
    return any(other in present and params[other] is params[name] for other in params if other != name)


def _few(names: list[str]) -> str:
    return "none" if not names else ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def compare_reloaded_logits(
    directory: Path,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    reference: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    rtol: float,
    load_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Reload `directory` in `dtype` on `device` (or over the devices of `load_kwargs`' device_map, as the original
    was) and compare its logits with `reference`; raise on a mismatch."""
    from transformers import AutoModelForCausalLM

    load_kwargs = load_kwargs or {}
    try:
        reloaded, info = AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, output_loading_info=True, **load_kwargs
        )
    except Exception as exc:
        raise LayerpruneError(f"surgery check failed: the written model does not load: {one_line(exc)[:300]}") from exc
    problems = {key: sorted(info.get(key) or []) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        raise LayerpruneError(
            f"surgery check failed: reloading the written model reports {_loading(problems)}; nothing was written"
        )
    if not load_kwargs.get("device_map"):
        reloaded.to(device)
    reloaded.eval()
    with torch.inference_mode():
        logits = reloaded(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    del reloaded
    return check_logits_agree(logits, reference, rtol, WRITTEN_LOGITS_DIFFER, then="nothing was written").record()


def _loading(problems: dict[str, list[Any]]) -> str:
    return "; ".join(
        f"{key.replace('_', ' ')}: {_few([str(k) for k in keys])}" for key, keys in problems.items() if keys
    )


def verify_surgery(
    model: nn.Module,
    directory: Path,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    reference: torch.Tensor,
    lossless: bool,
    load_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Both checks on a pruned in-memory `model` written to `directory`; a record of what was compared."""
    start = time.perf_counter()
    keys = check_config_matches_weights(model)
    compute = next(model.parameters()).dtype
    record = compare_reloaded_logits(
        directory, input_ids, attention_mask, reference, compute, input_ids.device, logits_rtol(compute, lossless),
        load_kwargs,
    )
    return {
        "checked": True,
        "keys": keys,
        "tokens": int(input_ids.numel()),
        **record,
        "seconds": round(time.perf_counter() - start, 2),
    }
