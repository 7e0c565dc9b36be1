"""The --dry-run memory estimate side by side with the measured peak of real training steps.

    python bench/bench_recover.py --device cpu     # small Llama, float32, peak RSS growth in a fresh process
    python bench/bench_recover.py --sizes          # LoRA and KD plans at three sizes (7M, 27M, 60M), on the CPU
    python bench/bench_recover.py --device cuda    # SmolLM2-135M architecture (random weights), bf16,
                                                   # torch.cuda.max_memory_allocated growth

Each row: method, gradient checkpointing, batch x sequence, estimate, measured, estimate / measured.
Only torch, transformers and peft are needed (the estimate module is loaded by path).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)
CUDA_CASES = [("full", False, 4, 2048), ("full", True, 4, 2048), ("lora", False, 4, 2048), ("lora", True, 4, 2048),
              ("lora", True, 4, 8192), ("full", True, 8, 4096)]


def load_memory_module():
    spec = importlib.util.spec_from_file_location("memory", ROOT / "src" / "layerprune" / "recover" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory"] = module
    spec.loader.exec_module(module)
    return module


def measure_cuda(config_kwargs: dict, method: str, checkpointing: bool, batch: int, seq: int, r: int = 64) -> float:
    """Peak allocated CUDA memory growth of two bf16 training steps (weights included)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    config = LlamaConfig(**config_kwargs)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    if checkpointing:
        model.gradient_checkpointing_enable()
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=16, target_modules="all-linear"))
        if checkpointing:
            model.enable_input_require_grads()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, optimizer
    return peak


def run_cuda(memory) -> list[dict]:
    from transformers import LlamaConfig

    shape = memory.model_shape(LlamaConfig(**SMOLLM2))
    rows = []
    for method, ckpt, batch, seq in CUDA_CASES:
        plan = memory.plan_memory(shape, method, seq_len=seq, batch_size=batch, weight_bytes=2, lora_r=64,
                                  gradient_checkpointing=ckpt)
        measured = measure_cuda(SMOLLM2, method, ckpt, batch, seq)
        rows.append(dict(model="SmolLM2-135M (bf16)", method=method, checkpointing=ckpt, batch=batch, seq=seq,
                         estimate_gb=round(plan.total, 3), measured_gb=round(measured / 1e9, 3),
                         ratio=round(plan.total * 1e9 / measured, 3)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


# three sizes of one Llama shape (about 7M, 27M and 60M parameters), for the plan's error per method and size
SIZES = {
    "7M": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False),
    "27M": None,  # the test's SMALL
    "60M": dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False),
}
SIZE_CASES = [
    dict(method="lora", checkpointing=True, batch=4, seq=512, r=16),
    dict(method="lora", checkpointing=False, batch=4, seq=256, r=16),
    dict(method="kd", checkpointing=True, batch=4, seq=256, r=16, teacher_layers=12),
    dict(method="kd", checkpointing=False, batch=4, seq=256, r=16, teacher_layers=12),
]


def cpu_row(name: str, case: dict, config: dict | None) -> dict:
    """One case measured in a fresh process beside its plan."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_recover_memory import estimate, measure_peak

    measured, predicted = measure_peak(**case, config=config), estimate(**case, config=config)
    row = dict(model=name, **case, estimate_gb=round(predicted / 1e9, 3), measured_gb=round(measured / 1e9, 3),
               ratio=round(predicted / measured, 3))
    print(json.dumps(row), flush=True)
    return row


def run_cpu(memory) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_recover_memory import CASES, SMALL

    name = f"Llama h{SMALL['hidden_size']} x{SMALL['num_hidden_layers']} (fp32)"
    extra = [dict(method="full", checkpointing=True, batch=4, seq=512, r=0),
             dict(method="lora", checkpointing=False, batch=4, seq=256, r=16)]
    return [cpu_row(name, case, None) for case in CASES + extra]


def run_sizes() -> list[dict]:
    """LoRA and KD, with and without checkpointing, at three model sizes (the teacher: 12 blocks of the same shape)."""
    rows = [cpu_row(f"Llama {size} (fp32)", case, config) for size, config in SIZES.items() for case in SIZE_CASES]
    for method in ("lora", "kd"):
        ratios = [row["ratio"] for row in rows if row["method"] == method]
        print(f"{method}: plan / measured {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} cases", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sizes", action="store_true", help="CPU: LoRA and KD at three model sizes (7M, 27M, 60M)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    memory = load_memory_module()
    if args.device == "cuda":
        rows = run_cuda(memory)
    else:
        rows = run_sizes() if args.sizes else run_cpu(memory)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
