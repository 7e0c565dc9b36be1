"""A comparison flags roles scored in another dtype, backend or device; the record is the model's own precision."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerprune.core.settings import RunSettings
from layerprune.evaluate.handle import ModelHandle
from layerprune.evaluate.report import role_row
from layerprune.evaluate.summary import TaskResult
from layerprune.models import LoadedModel, ModelSource


def result(**settings) -> TaskResult:
    return TaskResult(task="piqa", kind="classification", metric="acc", value=0.7, stderr=0.01, n=100,
                      headline=True, settings={"limit": 100, **settings}, seconds=1.0)


def test_a_bf16_vllm_baseline_against_an_fp32_hf_model_is_flagged():
    row = role_row("piqa", {"baseline": result(dtype="torch.bfloat16", backend="vllm", device="cuda"),
                            "pruned": result(dtype="torch.float32", backend="hf", device="cpu")})
    assert set(row["settings_differ"]) == {"dtype", "backend", "device"}
    assert row["retention_pruned"] is None and row["clear_drop"] is False
    same = role_row("piqa", {"baseline": result(dtype="torch.bfloat16", backend="hf", device="cuda"),
                             "pruned": result(dtype="torch.bfloat16", backend="hf", device="cuda")})
    assert same["settings_differ"] == {}


def test_a_model_already_in_memory_records_its_own_dtype(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    loaded = LoadedModel(model, AutoTokenizer.from_pretrained(tiny_llama), ModelSource("m", str(tiny_llama), "local"))
    run = RunSettings(device="cpu", dtype="bfloat16")
    assert ModelHandle(loaded.source, run, loaded=loaded).precision() == ("torch.float32", "cpu")
    assert ModelHandle(loaded.source, run).precision() == ("torch.bfloat16", "cpu")
