"""Nemotron-NAS (DeciLM) causal LM for transformers: Llama blocks whose attention or FFN may be absent (`no_op`),
each with its own key-value head count and FFN width.

Built from transformers' own Llama pieces (attention, MLP, RMSNorm, rotary embedding), so a block with both parts
computes exactly what a Llama block does. A block without attention has no input_layernorm and no KV cache entry;
one without FFN has no post_attention_layernorm: the same weights vLLM's `DeciLMForCausalLM` and llama.cpp's `deci`
architecture read. Attention layers are numbered among themselves in the KV cache (the cache holds only them).
Self-contained (torch and transformers only): a saved model carries this file beside its config.json. Runs on every
transformers 5 (5.0's mask and cache calling conventions included).
"""

import copy
import inspect
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from .configuration_decilm import BlockConfig, DeciLMConfig, ffn_mult_to_intermediate_size

# transformers renamed the outputs' `past_key_values` to `cache`; write whichever this version has
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# transformers 5.0's create_causal_mask takes the cache positions and `past_key_values`; later ones the cache alone
MASK_TAKES_CACHE_POSITION = "cache_position" in inspect.signature(create_causal_mask).parameters


def causal_mask(config: Any, embeds: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None,
                position_ids: torch.Tensor) -> Any:
    """transformers' causal mask (what its Llama uses), called as this version of transformers takes it."""
    if not MASK_TAKES_CACHE_POSITION:
        return create_causal_mask(config, embeds, attention_mask, cache, position_ids=position_ids)
    past = cache.get_seq_length() if cache is not None else 0
    positions = torch.arange(past, past + embeds.shape[1], device=embeds.device)
    return create_causal_mask(config=config, input_embeds=embeds, attention_mask=attention_mask,
                              cache_position=positions, past_key_values=cache, position_ids=position_ids)


def _check_block(block: BlockConfig, index: int) -> None:
    unsupported = [name for name, used in (
        ("attention.replace_with_linear", block.attention.replace_with_linear),
        ("ffn.replace_with_linear", block.ffn.replace_with_linear),
        ("attention.window_length", block.attention.window_length is not None),
        ("attention.num_sink_tokens", block.attention.num_sink_tokens is not None),
        ("attention.unshifted_sink", block.attention.unshifted_sink),
        ("sparsify", bool(block.attention.sparsify or block.ffn.sparsify)),
    ) if used]
    if unsupported:
        raise NotImplementedError(f"block {index} uses {', '.join(unsupported)}, which this DeciLM implementation "
                                  "does not run (it runs full attention, gated MLPs and no_op)")
    if not block.attention.no_op and not block.attention.n_heads_in_group:
        raise ValueError(f"block {index} has attention but no n_heads_in_group")
    if not block.ffn.no_op and not block.ffn.ffn_mult:
        raise ValueError(f"block {index} has an FFN but no ffn_mult")


class DeciLMAttention(LlamaAttention):
    """Llama attention with this block's key-value head count, at `cache_index` in the KV cache."""

    def __init__(self, config: DeciLMConfig, cache_index: int, n_heads_in_group: int) -> None:
        layer_config = copy.copy(config)
        layer_config.num_key_value_heads = config.num_attention_heads // n_heads_in_group
        super().__init__(layer_config, cache_index)
        self.config = config  # the shared one: attention implementation changes reach every layer


class DeciLMDecoderLayer(GradientCheckpointingLayer):
    """A Llama block whose attention and FFN are each present or absent."""

    def __init__(self, config: DeciLMConfig, layer_idx: int, cache_index: int) -> None:
        super().__init__()
        block = config.block_configs[layer_idx]
        _check_block(block, layer_idx)
        self.has_attention = not block.attention.no_op
        self.has_ffn = not block.ffn.no_op
        if self.has_attention:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attn = DeciLMAttention(config, cache_index, block.attention.n_heads_in_group)
        if self.has_ffn:
            ffn_config = copy.copy(config)
            ffn_config.intermediate_size = ffn_mult_to_intermediate_size(block.ffn.ffn_mult, config.hidden_size)
            self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = LlamaMLP(ffn_config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.has_attention:  # cache passed by position: transformers renamed the keyword
            attended, _ = self.self_attn(
                self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, **kwargs
            )
            hidden_states = hidden_states + attended
        if self.has_ffn:
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


class DeciLMPreTrainedModel(PreTrainedModel):
    config_class = DeciLMConfig
    config: DeciLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeciLMDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True


class DeciLMModel(DeciLMPreTrainedModel):
    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        attends = [not block.attention.no_op for block in config.block_configs]
        self.layers = nn.ModuleList(
            DeciLMDecoderLayer(config, index, sum(attends[:index])) for index in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        output_hidden_states = output_hidden_states if output_hidden_states is not None else False
        kwargs.pop("return_dict", None)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache()
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0) + past
        mask = causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        states = [hidden_states]
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings,
                                  cache=cache, position_ids=position_ids, **kwargs)
            states.append(hidden_states)
        hidden_states = self.norm(hidden_states)
        states[-1] = hidden_states
        return BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                       hidden_states=tuple(states) if output_hidden_states else None,
                                       **{CACHE_FIELD: cache if use_cache else None})


class DeciLMForCausalLM(DeciLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        self.model = DeciLMModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                             use_cache=use_cache, **kwargs)
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                      **{CACHE_FIELD: outputs[CACHE_FIELD] if CACHE_FIELD in outputs else None})


__all__ = ["DeciLMForCausalLM", "DeciLMModel", "DeciLMPreTrainedModel"]
