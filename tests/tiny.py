"""Tiny random decoder-only models of each supported architecture, built offline in a temp dir."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "Question: what is 12 + 7? Answer: 19", "The quick brown fox jumps over the lazy dog.",
    "( [ { } ] ) 0 1 2 3 4 5 6 7 8 9 + - * = #### ", "You are a helpful assistant.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
] * 20

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, head_dim=16)

ARCHS: dict[str, dict] = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=8),
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=3),
    "qwen3": dict(model_type="qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=3),
    "gemma2": dict(model_type="gemma2", sliding_window=8, query_pre_attn_scalar=16, final_logit_softcapping=30.0),
    "gemma3_text": dict(model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                     "sliding_attention", "sliding_attention", "full_attention"]),
    "phi3": dict(model_type="phi3", pad_token_id=0),
    "olmo2": dict(model_type="olmo2"),
}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Families whose config describes blocks by index, period or threshold, or whose head scales the logits.
MORE_ARCHS: dict[str, dict] = {
    "qwen3_moe": dict(model_type="qwen3_moe", **MOE, mlp_only_layers=[0, 3]),
    "qwen3_moe_step": dict(model_type="qwen3_moe", **MOE, decoder_sparse_step=2),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_group=1, topk_group=1, first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1, head_dim=8,
                        num_key_value_heads=4),  # MLA: one latent KV per head, as in the real model
    "llama4_text": dict(model_type="llama4_text", num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                        moe_layers=[1, 3, 4], no_rope_layers=[1, 1, 1, 0, 1, 1]),
    "granite": dict(model_type="granite", logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0,
                    attention_multiplier=0.2),
    "cohere2": dict(model_type="cohere2", logit_scale=0.25, sliding_window=8),
    "jamba": dict(model_type="jamba", **{k: v for k, v in MOE.items() if k != "moe_intermediate_size"},
                  attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8),
    "falcon_h1": dict(model_type="falcon_h1", lm_head_multiplier=0.5, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                      mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=16, mamba_d_conv=4),
    "bamba": dict(model_type="bamba", attn_layer_indices=[1, 4], mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32,
                  mamba_n_groups=1, mamba_chunk_size=16, mamba_d_conv=4, mamba_expand=2),
    # hybrid (shared attention) blocks 2 and 4
    "zamba": dict(model_type="zamba", attn_layer_period=3, attn_layer_offset=1, mamba_d_state=8,
                  attention_hidden_size=128, attention_head_dim=32, n_mamba_heads=2),
    "gemma3n_text": dict(model_type="gemma3n_text", vocab_size_per_layer_input=384, hidden_size_per_layer_input=8,
                         num_kv_shared_layers=2, sliding_window=8, laurel_rank=8, altup_num_inputs=2,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, layers: int = 6):
    from transformers import AutoConfig

    spec = dict({**ARCHS, **MORE_ARCHS}[arch])
    model_type = spec.pop("model_type")
    kwargs = {**COMMON, **spec, "num_hidden_layers": layers, "bos_token_id": 1, "eos_token_id": 2}
    kwargs.setdefault("pad_token_id", 0)
    if "layer_types" in kwargs:
        kwargs["layer_types"] = kwargs["layer_types"][:layers]
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_model(directory: Path, arch: str = "llama", layers: int = 6, seed: int = 0) -> Path:
    """Save a random tiny model with tokenizer and chat template to `directory`; return it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers))
    with torch.no_grad():  # random residual scale so that every block matters a little
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer().save_pretrained(directory)
    return directory
