"""The one vLLM engine builder (models/vllm_engine) and check-serve's refusals, without vLLM."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from helpers import run_cli
from layerprune.core.settings import RunSettings
from layerprune.models.verification import Reference
from layerprune.models.vllm_engine import EngineSettings, engine_settings, llm_kwargs, lm_eval_kwargs


def test_engine_arguments_on_a_cpu_and_on_a_gpu():
    settings = EngineSettings(dtype="float32", seed=3, max_model_len=64, max_num_seqs=4, gpu_memory=0.4)
    cpu, gpu = llm_kwargs("m", settings, cpu=True), llm_kwargs("m", settings, cpu=False)
    assert cpu == {"model": "m", "tokenizer": "m", "dtype": "float32", "seed": 3, "tensor_parallel_size": 1,
                   "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4}
    assert gpu["gpu_memory_utilization"] == 0.4 and gpu["enforce_eager"] is False
    assert llm_kwargs("m", EngineSettings(eager=False), cpu=True)["enforce_eager"] is False


def test_the_run_settings_give_the_dtype_transformers_loads_and_lm_eval_the_same_engine():
    engine = engine_settings(RunSettings(device="cpu", seed=7, vllm_cpu_kv_cache_gib=2.5))
    assert (engine.dtype, engine.seed, engine.cpu_kv_cache_gib) == ("float32", 7, 2.5)
    args = lm_eval_kwargs("dir", engine, 8)
    assert args["pretrained"] == "dir" and "model" not in args and args["batch_size"] == 8


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_check_serve_without_vllm_is_one_line_naming_the_install(tiny_llama, capsys):
    code, _, err = run_cli(capsys, ["check-serve", str(tiny_llama)])
    assert code == 2 and err.startswith("error: check-serve needs vLLM: pip install 'layerprune[vllm]'")
    assert len(err.strip().splitlines()) == 1


def test_vllm_trusts_the_configuration_code_of_our_layout_only(tmp_path):
    """vLLM has no config class for nemotron-nas: it must run the folder's configuration file; it is told to trust
    it only when the file is layerprune's own, byte for byte."""
    from layerprune.models.nemotron_nas import write_layout_files

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    write_layout_files(tmp_path)
    assert llm_kwargs(str(tmp_path), EngineSettings(), cpu=True)["trust_remote_code"] is True
    with (tmp_path / "configuration_decilm.py").open("a") as handle:
        handle.write("\nimport os  # someone else's code\n")
    assert "trust_remote_code" not in llm_kwargs(str(tmp_path), EngineSettings(), cpu=True)
    assert "trust_remote_code" not in llm_kwargs("m", EngineSettings(), cpu=True)


def test_the_serving_check_runs_the_engine_in_this_process_and_leaves_the_environment_as_it_was(monkeypatch):
    """A spawned engine core is a second interpreter to start (about half of a CPU start): the serving check's engine
    is built with VLLM_ENABLE_V1_MULTIPROCESSING=0, the variable gone again after; a user's own setting wins."""
    import sys
    import types

    from layerprune.models import serving
    from layerprune.models.vllm_engine import MULTIPROCESSING_ENV

    seen = []
    logprob = types.SimpleNamespace(logprob=-0.1, rank=1)

    class LLM:
        def __init__(self, **kwargs):
            seen.append(os.environ.get(MULTIPROCESSING_ENV))

        def generate(self, prompts, params):
            answer = types.SimpleNamespace(token_ids=[5, 6], logprobs=[{5: logprob}])
            return [types.SimpleNamespace(prompt_logprobs=[None] + [{5: logprob}] * (len(p["prompt_token_ids"]) - 1),
                                          outputs=[answer]) for p in prompts]

    fake = types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(serving, "shutdown_llm", lambda llm: None)
    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    expected = Reference([[1, 2], [3]], [[4], []], [], [], [2])
    found, _ = serving.vllm_answers("m", expected, RunSettings(device="cpu"))
    assert found.continuations == [[5, 6], [5, 6]] and found.top1 == [[5, 5, 5], [5]]
    assert found.logprobs[1] == [{5: -0.1}] and seen == ["0"] and MULTIPROCESSING_ENV not in os.environ
    monkeypatch.setenv(MULTIPROCESSING_ENV, "1")
    serving.vllm_answers("m", expected, RunSettings(device="cpu"))
    assert seen == ["0", "1"] and os.environ[MULTIPROCESSING_ENV] == "1"
