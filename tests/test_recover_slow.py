"""recover on the real embedded SmolLM2-135M (slow: minutes on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL_DEMO = ["--recipe", "demo", "--samples", "16", "--max-new-tokens", "16", "--max-steps", "3",
              "--train-eval-steps", "3", "--device", "cpu"]


@pytest.mark.slow
def test_demo_recipe_lowers_held_out_loss_and_the_merged_model_generates(shared_data, tmp_path):
    out = tmp_path / "demo"
    assert main(["recover", *SMALL_DEMO, "--data-dir", str(shared_data), "-o", str(out)]) == 0
    report = json.loads((out / "recover_report.json").read_text())
    assert report["held_out_loss"]["after"] < report["held_out_loss"]["before"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 24
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    assert model.generate(**ids, max_new_tokens=8, do_sample=False).shape[1] > ids["input_ids"].shape[1]


@pytest.mark.slow
def test_demo_recipe_as_two_cpu_processes_over_gloo(shared_data, tiny_models, tmp_path):
    """The demo recipe under `accelerate launch` with the CPU DDP config: both processes generate and train, one
    saves. On a tiny model (the real model's recovery is the test above; two processes are the same code path)."""
    out = tmp_path / "demo-ddp"
    config = ROOT / "src" / "layerprune" / "accelerate" / "ddp-cpu.yaml"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "-m",
        "layerprune.cli",
        "recover",
        *SMALL_DEMO,
        "--model",
        str(tiny_models("llama", 6)),
        "--drop-blocks",
        "2,3",
        "--samples",
        "8",
        "--max-steps",
        "2",
        "--max-new-tokens",
        "16",
        "--held-out",  # the held-out evaluation over two processes is the FSDP tests' (test_recover_distributed)
        "0",
        "--data-dir",
        str(shared_data),
        "-o",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "recover_report.json").read_text())
    assert report["data"]["steps"] == 2 and report["data"]["generation"]["processes"] == 2
    assert (out / "model.safetensors").is_file() and report["recipe"]["drop_blocks"] == [2, 3]
