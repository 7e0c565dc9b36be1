"""recover as two CPU processes with FSDP2 over gloo: every rank trains, the saved model equals the gathered weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import make_pruned_student

HERE = Path(__file__).resolve().parent
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_RESHARD_AFTER_FORWARD": "true",
            "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "OMP_NUM_THREADS": "1"}  # as accelerate/fsdp.yaml sets them
FAST = ["--max-new-tokens", "6", "--no-generate-drop-truncated", "--samples", "8", "--train-max-length", "64",
        "--train-batch-size", "2", "--max-steps", "2", "--held-out", "0.25", "--train-warmup-steps", "0",
        "--no-train-gradient-checkpointing", "--learning-rate", "1e-2", "--lora-r", "4", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def pruned(tiny_models, tmp_path_factory) -> Path:
    return make_pruned_student(tiny_models("llama", 6), tmp_path_factory.mktemp("pruned") / "p2")


METHODS = {"full": [], "lora": [], "kd": [], "opd": ["--opd-max-new-tokens", "6", "--train-grad-accum", "1"]}


@pytest.fixture(scope="module")
def fsdp_runs(pruned, tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """torchrun two processes that recover with each method in turn (one start of the group for the four); method
    -> (its output, the weights gathered from both ranks when its training ended)."""
    root = tmp_path_factory.mktemp("fsdp")
    runs = [{"args": ["--model", str(pruned), "--prompts", str(pruned.parent / "prompts.jsonl"), "-o",
                      str(root / method), "--method", method, *FAST, *extra],
             "gathered": str(root / f"gathered-{method}.pt")} for method, extra in METHODS.items()]
    env = {**os.environ, **FSDP_ENV, "RECOVER_RUNS": json.dumps(runs), "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(HERE / "fsdp_cpu.py")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {method: (root / method, torch.load(root / f"gathered-{method}.pt")) for method in METHODS}


def merged_lora(gathered: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """W + scale * B @ A for every adapted linear, by hand, with peft's prefixes stripped."""
    merged = {}
    for key, value in gathered.items():
        name = key.removeprefix("base_model.model.")
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            module = key.split(".base_layer.")[0]
            delta = gathered[f"{module}.lora_B.default.weight"] @ gathered[f"{module}.lora_A.default.weight"]
            value = value + scale * delta
            name = name.replace(".base_layer.", ".")
        merged[name] = value
    return merged


def check_outputs(out: Path, pruned: Path, expected: dict[str, torch.Tensor], responses: int = 8) -> None:
    saved = load_file(out / "model.safetensors")
    student = load_file(pruned / "model.safetensors")
    assert set(saved) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(saved[k], student[k]) for k in saved), "training changed nothing"
    report = json.loads((out / "recover_report.json").read_text())
    assert report["data"]["steps"] == 2 and report["data"]["generation"]["processes"] == 2
    assert len((out / "data" / "responses.jsonl").read_text().splitlines()) == responses
    assert not list(out.parent.glob("*.rank*.jsonl"))


@pytest.mark.slow
def test_fsdp_full_sft_on_two_cpu_processes_saves_the_gathered_weights(pruned, fsdp_runs):
    out, gathered = fsdp_runs["full"]
    check_outputs(out, pruned, gathered)


@pytest.mark.slow
def test_fsdp_lora_on_two_cpu_processes_merges_the_gathered_adapter(pruned, fsdp_runs):
    out, gathered = fsdp_runs["lora"]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    check_outputs(out, pruned, merged_lora(gathered, config["lora_alpha"] / config["r"]))


@pytest.mark.slow
def test_fsdp_kd_on_two_cpu_processes_saves_through_the_trainer_and_merges_once(pruned, fsdp_runs):
    out, gathered = fsdp_runs["kd"]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    check_outputs(out, pruned, merged_lora(gathered, config["lora_alpha"] / config["r"]))


@pytest.mark.slow
def test_fsdp_opd_on_two_cpu_processes_saves_through_the_trainer_and_merges_once(pruned, fsdp_runs):
    out, gathered = fsdp_runs["opd"]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    # fully on-policy: the teacher answered only the held-out prompts
    check_outputs(out, pruned, merged_lora(gathered, config["lora_alpha"] / config["r"]), responses=2)
