"""Sublayer surgery: a Llama-, Qwen2- or Mistral-family model with some attention or MLP sublayers removed, in the
Nemotron-NAS (DeciLM) layout that vLLM serves and llama.cpp converts.

A removed sublayer becomes `no_op` in its block's `block_configs` entry; a block with both removed is dropped. What
the layout (or the engines that read it) cannot express is refused in one line before anything is written:
`check_expressible` names each case. `save_nas` writes the folder atomically and proves it, as every surgery here
is proved: the reloaded model gives the original's logits with the removed sublayers skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import atomic_output_dir, check_output_dir
from layerprune.models.nemotron_nas import (
    DeciLMConfig,
    DeciLMForCausalLM,
    ffn_mult_to_intermediate_size,
    write_layout_files,
)
from layerprune.models.sublayers import Sublayer, skipped_sublayers, whole_blocks
from layerprune.models.surgery import check_config_matches_weights, dtype_name, verify_surgery, write_pretrained
from layerprune.models.verification import VERIFY_PROMPTS

FAMILIES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "llama3")  # llama.cpp's deci converter writes rope_theta and llama3's factors, nothing else
CARRIED = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache", "pad_token_id",
           "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters", "attention_dropout", "head_dim")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")  # carried as they are, None included
PART_KEYS = {"attn": ("input_layernorm.", "self_attn."), "mlp": ("post_attention_layernorm.", "mlp.")}


def ffn_mult(intermediate_size: int, hidden_size: int) -> float:
    """The `ffn_mult` whose published rounding gives `intermediate_size`; one line when none does."""
    mult = round(3 * intermediate_size / (2 * hidden_size), 6)
    if ffn_mult_to_intermediate_size(mult, hidden_size) != intermediate_size:
        raise LayerpruneError(
            f"the Nemotron-NAS layout cannot express intermediate size {intermediate_size}: it derives the size from "
            f"ffn_mult as int(2*ffn_mult*{hidden_size}/3) rounded up to a multiple of 256"
        )
    return mult


def check_expressible(config: Any, removed: Sequence[Sublayer]) -> None:
    """Refuse, in one line, a model or a removal the layout, vLLM or llama.cpp's `deci` cannot carry exactly."""
    family = getattr(config, "model_type", "")
    if family not in FAMILIES:
        raise LayerpruneError(f"the Nemotron-NAS layout takes Llama, Qwen2 and Mistral models, not '{family}'; "
                              "prune it by whole blocks")
    _check_attention(config)
    ffn_mult(config.intermediate_size, config.hidden_size)
    if config.hidden_act != "silu":
        raise LayerpruneError(f"the Nemotron-NAS layout runs SiLU-gated MLPs (llama.cpp's deci), "
                              f"not {config.hidden_act}")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in ROPE_TYPES:
        raise LayerpruneError(f"the Nemotron-NAS layout cannot carry rope type '{rope}' "
                              f"(llama.cpp's deci converter writes {' and '.join(ROPE_TYPES)} RoPE only)")
    _check_removal(config.num_hidden_layers, removed)


def _check_attention(config: Any) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if any(kind != "full_attention" for kind in layer_types) or (
        config.model_type == "mistral" and window is not None and window < config.max_position_embeddings
    ):
        raise LayerpruneError(f"the Nemotron-NAS layout has no sliding-window attention, and this "
                              f"{config.model_type} model uses a {window}-token window")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise LayerpruneError(f"the Nemotron-NAS layout needs head_dim = hidden_size / heads (llama.cpp's deci), "
                              f"and this model has head_dim {head_dim} with {config.num_attention_heads} heads "
                              f"of hidden size {config.hidden_size}")


def _check_removal(depth: int, removed: Sequence[Sublayer]) -> None:
    if any(not 0 <= sub.block < depth for sub in removed):
        raise LayerpruneError(f"a removed sublayer is out of range: the model has {depth} blocks (0-{depth - 1})")
    refusal = removal_refusal(depth, removed)
    if refusal is not None:
        raise LayerpruneError(refusal)


def removal_refusal(depth: int, removed: Sequence[Sublayer]) -> str | None:
    """Why the layout cannot serve a `depth`-block model without the `removed` sublayers (None when it can): the
    first block kept (not wholly removed) must keep its attention, which also keeps one attention sublayer."""
    kept = [block for block in range(depth) if block not in set(whole_blocks(removed))]
    gone = {(sub.block, sub.part) for sub in removed}
    if not kept or all((block, "attn") in gone for block in kept):
        return ("removing every attention sublayer leaves a model the Nemotron-NAS layout cannot serve (vLLM reads "
                "its KV heads from an attention block); keep at least one")
    if (kept[0], "attn") in gone:
        return (f"the first kept block ({kept[0]}) cannot lose its attention alone: vLLM's DeciLM starts its residual "
                f"stream in an attention sublayer; keep {kept[0]}.attn or remove {kept[0]}.mlp too")
    return None


def most_removable(depth: int, pool: Iterable[Sublayer]) -> int:
    """The most sublayers of `pool` the layout lets go together: all of them when some block whose attention is not
    in the pool has every block before it wholly in the pool (it stays first, with its attention), else all but one
    attention sublayer."""
    pool = set(pool)
    for block in range(depth):
        if Sublayer(block, "attn") not in pool:
            return len(pool)
        if Sublayer(block, "mlp") not in pool:
            break
    return max(len(pool) - 1, 0)


def nas_config(config: Any, removed: Sequence[Sublayer]) -> DeciLMConfig:
    """The DeciLM configuration of `config`'s model with `removed` no_op and wholly removed blocks dropped."""
    check_expressible(config, removed)
    gone = {(sub.block, sub.part) for sub in removed}
    dropped = set(whole_blocks(removed))
    group = config.num_attention_heads // config.num_key_value_heads
    mult = ffn_mult(config.intermediate_size, config.hidden_size)
    blocks = [_block((block, "attn") in gone, (block, "mlp") in gone, group, mult)
              for block in range(config.num_hidden_layers) if block not in dropped]
    values = {key: getattr(config, key) for key in CARRIED
              if getattr(config, key, None) is not None or (key in TOKEN_IDS and hasattr(config, key))}
    out = DeciLMConfig(**values, num_hidden_layers=len(blocks), block_configs=blocks,
                       attention_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
                       mlp_bias=bool(getattr(config, "mlp_bias", False)), architectures=["DeciLMForCausalLM"])
    out.dtype = getattr(config, "dtype", None)
    return out


def _block(attn_gone: bool, mlp_gone: bool, group: int, mult: float) -> dict[str, Any]:
    return {
        "attention": {"no_op": attn_gone, "replace_with_linear": False,
                      "n_heads_in_group": None if attn_gone else group},
        "ffn": {"no_op": mlp_gone, "replace_with_linear": False,
                "ffn_mult": None if mlp_gone else mult},
    }


def to_nas(model: nn.Module, removed: Sequence[Sublayer]) -> DeciLMForCausalLM:
    """`model` (a Llama/Qwen2/Mistral causal LM) as a DeciLM model without the `removed` sublayers.

    The new model shares the kept weights' storage with `model` (nothing is copied; `model` still runs as before).
    Qwen2's attention, which has q/k/v biases only, gets a zero o_proj bias: vLLM's and transformers' Llama
    attention take biases on all four projections or none.
    """
    config = nas_config(model.config, removed)
    state = _mapped_state(model, config, removed)
    with torch.device("meta"):
        nas = DeciLMForCausalLM(config)
    nas.load_state_dict(state, strict=True, assign=True)
    nas.tie_weights()
    device = next(model.parameters()).device
    nas.model.rotary_emb = LlamaRotaryEmbedding(config=config).to(device)
    meta = [name for name, tensor in [*nas.named_parameters(), *nas.named_buffers()] if tensor.is_meta]
    if meta:
        raise LayerpruneError(f"sublayer surgery left {len(meta)} tensors unset (e.g. {meta[0]})")
    nas.generation_config = model.generation_config
    return nas.eval()


def _mapped_state(model: nn.Module, config: DeciLMConfig, removed: Sequence[Sublayer]) -> dict[str, torch.Tensor]:
    gone = {(sub.block, sub.part) for sub in removed}
    dropped = set(whole_blocks(removed))
    kept = [block for block in range(model.config.num_hidden_layers) if block not in dropped]
    renumber = {old: new for new, old in enumerate(kept)}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith("model.layers."):
            state[name] = tensor
            continue
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        part = next((p for p, prefixes in PART_KEYS.items() if rest.startswith(prefixes)), None)
        if part is None:
            raise LayerpruneError(f"sublayer surgery does not know the weight {name}")
        if int(index) in renumber and (int(index), part) not in gone:
            state[f"model.layers.{renumber[int(index)]}.{rest}"] = tensor
    if config.attention_bias:
        for new, block in enumerate(config.block_configs):
            key = f"model.layers.{new}.self_attn.o_proj.bias"
            if not block.attention.no_op and key not in state:
                weight = state[f"model.layers.{new}.self_attn.o_proj.weight"]
                state[key] = torch.zeros(config.hidden_size, dtype=weight.dtype, device=weight.device)
    return state


def probe_batch(tokenizer: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification prompts as one padded batch on `device`."""
    enc = tokenizer(list(VERIFY_PROMPTS), return_tensors="pt", padding=True).to(device)
    return enc["input_ids"], enc["attention_mask"]


def skip_reference(
    model: nn.Module, removed: Sequence[Sublayer], input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """The original model's logits with the removed sublayers adding nothing (the reference a save must give)."""
    with skipped_sublayers(model, removed), torch.inference_mode():
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()


def save_nas(
    model: nn.Module,
    tokenizer: Any,
    removed: Sequence[Sublayer],
    output: Path,
    dtype: torch.dtype,
    *,
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    probe: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    finish: Callable[[Path, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Write `model` without the `removed` sublayers to `output` in the Nemotron-NAS layout, in `dtype`, and verify it.

    The folder (config with block_configs and auto_map, safetensors, the two modeling files, the tokenizer) appears
    whole or not at all: written in a temporary sibling, reloaded with layerprune's DeciLM class, its logits on
    `probe` (input ids and attention mask; by default the verification prompts) compared with the original's with
    the removed sublayers skipped, and only then renamed. `finish(tmp, record)` runs last inside the temporary
    folder (a caller's report and lineage files). `model` is left as it was. Returns what was removed and the
    verification record (max_abs_diff, tolerance, ...).
    """
    removed = sorted(set(removed))
    check_expressible(model.config, removed)
    if len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        raise LayerpruneError("sublayer surgery needs the model on one device; load it without a device map")
    check_output_dir(Path(output), overwrite)
    compute = next(model.parameters()).dtype
    input_ids, attention_mask = probe if probe is not None else probe_batch(tokenizer, model.device)
    start = time.perf_counter()
    reference = skip_reference(model, removed, input_ids, attention_mask)
    nas = to_nas(model, removed)
    with atomic_output_dir(Path(output), overwrite) as tmp:
        check_config_matches_weights(nas)
        write_pretrained(nas, tmp, dtype, max_shard_size, output)
        write_layout_files(tmp)
        tokenizer.save_pretrained(tmp)
        lossless = dtype in (compute, torch.float32)
        verified = verify_surgery(nas, tmp, input_ids, attention_mask, reference, lossless)
        record = {
            "layout": "nemotron-nas",
            "removed": [str(sub) for sub in removed],
            "dropped_blocks": whole_blocks(removed),
            "blocks": nas.config.num_hidden_layers,
            "dtype": dtype_name(dtype),
            "verification": {**verified, "seconds": round(time.perf_counter() - start, 2)},
        }
        if finish is not None:
            finish(tmp, record)
    return record
