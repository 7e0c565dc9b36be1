"""The saved Nemotron-NAS modeling files on the oldest transformers the project allows (5.0): a venv with that
transformers loads each saved folder with `trust_remote_code=True` and must give the skip reference's logits and the
same cached greedy continuation as layerprune's own class.

    python bench/bench_nas_transformers_floor.py                       # makes /tmp/nas-floor/venv (PyPI)
    python bench/bench_nas_transformers_floor.py --transformers 5.0.0 --venv /tmp/tf50

Tiny random Llama, Qwen2 and Mistral sources with attention and MLP sublayers removed (block 4 whole), saved by
layerprune; one line per family: transformers version, max |logit difference|, greedy continuation equal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

CHECK = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM
root = sys.argv[1]
for arch in json.loads(sys.argv[2]):
    ref = torch.load(f"{root}/{arch}.pt")
    model = AutoModelForCausalLM.from_pretrained(f"{root}/{arch}", trust_remote_code=True).eval()
    with torch.inference_mode():
        diff = (model(ref["ids"]).logits.float() - ref["logits"]).abs().max().item()
    gen = model.generate(ref["ids"][:1], max_new_tokens=8, do_sample=False).tolist()
    print(json.dumps({"transformers": transformers.__version__, "family": arch, "class": type(model).__module__,
                      "max_abs_logit_diff": diff, "greedy_equal": gen == ref["greedy"]}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transformers", default="5.0.0")
    parser.add_argument("--work", type=Path, default=Path("/tmp/nas-floor"))
    parser.add_argument("--venv", type=Path, default=None, help="a venv that already has torch and transformers")
    args = parser.parse_args()
    families = ["llama", "qwen2", "mistral"]
    _save(args.work, families)
    python = args.venv / "bin" / "python" if args.venv else _venv(args.work / "venv", args.transformers)
    subprocess.run([str(python), "-c", CHECK, str(args.work), json.dumps(families)], check=True)


def _save(root: Path, families: list[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from layerprune.models.loading import load_model
    from layerprune.models.nas_surgery import save_nas, skip_reference
    from layerprune.models.sublayers import Sublayer
    from tiny import tiny_config, tiny_tokenizer  # noqa: E402

    removed = [Sublayer(1, "attn"), Sublayer(2, "mlp"), Sublayer(4, "attn"), Sublayer(4, "mlp")]
    changes = {"llama": {}, "qwen2": {"use_sliding_window": False, "layer_types": ["full_attention"] * 6,
                                      "tie_word_embeddings": True}, "mistral": {"sliding_window": None}}
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 50, 60, 70, 80, 90, 100, 110, 120]])
    for arch in families:
        config = tiny_config(arch, 6)
        for key, value in {"intermediate_size": 256, **changes[arch]}.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.08)
        folder = root / arch
        shutil.rmtree(folder, ignore_errors=True)
        save_nas(model, tiny_tokenizer(), removed, folder, torch.float32)
        greedy = load_model(str(folder)).model.generate(ids[:1], max_new_tokens=8, do_sample=False).tolist()
        torch.save({"ids": ids, "logits": skip_reference(model, removed, ids, None), "greedy": greedy},
                   root / f"{arch}.pt")


def _venv(path: Path, version: str) -> Path:
    python = path / "bin" / "python"
    if not python.exists():
        venv.create(path, with_pip=True)
        import torch

        torch_pin = torch.__version__.split("+")[0]  # the CPU build on this disk, as the project installs it
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={torch_pin}"], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"transformers=={version}", "safetensors"],
                       check=True)
    return python


if __name__ == "__main__":
    main()
