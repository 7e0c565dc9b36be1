"""bench/gpu_check.py's CPU form (--device cpu --tiny): every step runs and lands in the JSON and the Markdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_form_runs_every_step(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    out = tmp_path / "gpu_check.json"
    results = gpu_check.main(["--device", "cpu", "--tiny", "--budget-s", "100000", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results, default=str))
    failed = {name: r for name, r in results.items() if isinstance(r, dict) and ("error" in r or "skipped" in r)}
    assert not failed, failed
    for model in ("llama31-8b", "qwen25-7b"):
        assert results[f"{model}: streaming prune"]["verification"]["logits_check"] == "block-major"
    assert results["llama31-8b: ablation (prefix reuse)"]["max_abs_loss_diff"] < 1e-3
    assert {f"llama31-8b: train {m}" for m in ("lora", "full", "kd")} <= set(results)
    markdown = out.with_suffix(".md").read_text()
    assert "llama31-8b: train kd" in markdown and "qwen25-7b: streaming prune" in markdown


def test_the_shipped_configs_are_the_real_sizes():
    from transformers import AutoConfig

    from layerprune.recover.memory import model_shape

    sizes = {name: model_shape(AutoConfig.from_pretrained(ROOT / "bench/configs" / f"{name}.json")).params
             for name in ("llama-3.1-8b", "qwen2.5-7b")}
    assert round(sizes["llama-3.1-8b"] / 1e6) == 8030 and round(sizes["qwen2.5-7b"] / 1e6) == 7616


def test_the_prune_child_keeps_the_callers_python_path(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    monkeypatch.setenv("PYTHONPATH", "/tmp/site")  # where the GPU machine's missing packages are installed
    assert gpu_check._child_env()["PYTHONPATH"].split(":") == [str(ROOT / "src"), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert gpu_check._child_env()["PYTHONPATH"] == str(ROOT / "src")
