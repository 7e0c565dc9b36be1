"""export --outtype q4_k_m / q6_k: llama.cpp's own quantizer on the F16 file, run by llama.cpp against transformers
before the file takes its name; unknown types, a missing llama-cpp-python and a failed check write nothing."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from helpers import run_cli
from layerprune.core import extras
from layerprune.core.errors import LayerpruneError
from layerprune.export import export_gguf, quantize
from test_export import smollm_gguf

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="the quantizer needs llama-cpp-python (make bench-engines builds it)")


@pytest.fixture(scope="module")
def k_quantable(tmp_path_factory) -> Path:
    """A tiny random llama whose every 2-D weight has rows of 256 or 512 (k-quants' super-block is 256, narrower
    rows get a fallback type), with SmolLM2's vocabulary and its GGUF as the recorded source."""
    source = smollm_gguf()
    directory = tmp_path_factory.mktemp("k-quantable") / "tiny"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(directory)
    (directory / "source.json").write_text(json.dumps({"gguf": str(source)}))
    return directory


@pytest.fixture(scope="module")
def f16_bytes(k_quantable, tmp_path_factory) -> int:
    return export_gguf(k_quantable, tmp_path_factory.mktemp("f16") / "f16.gguf", "f16", verify=False).bytes


@needs_llama_cpp
@pytest.mark.parametrize(("name", "types"), [("Q4_K_M", {"F32", "Q4_K", "Q6_K"}),
                                             pytest.param("q6_k", {"F32", "Q6_K"}, marks=pytest.mark.slow)])
def test_a_k_quant_is_llama_cpps_own_smaller_than_f16_and_runs_in_llama_cpp(k_quantable, f16_bytes, tmp_path, name,
                                                                              types):
    report = export_gguf(k_quantable, tmp_path / "q.gguf", name)
    fields = gguf.GGUFReader(tmp_path / "q.gguf").fields
    assert fields["general.file_type"].contents() == gguf.LlamaFileType[f"MOSTLY_{name.upper()}"]
    assert report.quantized["file_type"] == f"MOSTLY_{name.upper()}"
    assert set(report.quantized["tensor_types"]) == types  # no fallback: every row is a multiple of 256
    assert report.bytes < 0.6 * f16_bytes
    back = report.readback  # llama.cpp loaded and ran it, within the type's bound
    assert back["runner"] == "llama.cpp" and 0 <= back["mean_kl"] <= quantize.TOLERANCE[name.lower()]
    assert back["positions"] >= 39 and back["passed"]  # prompt + continuation; 4-bit: near-ties below 1.0 nats
    assert report.per_layer["block_count"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.export.json", "q.gguf"]


@needs_llama_cpp
def test_a_quantized_file_past_its_tolerance_is_refused_and_nothing_is_left(k_quantable, tmp_path, monkeypatch):
    monkeypatch.setitem(quantize.TOLERANCE, "q4_k_m", -1.0)
    with pytest.raises(LayerpruneError, match=r"nats \(mean KL\) off transformers', past q4_k_m's -1.0; nothing "):
        export_gguf(k_quantable, tmp_path / "q.gguf", "q4_k_m")
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_type_is_refused_in_one_line_with_the_close_ones(tiny_llama, tmp_path, capsys):
    capsys.readouterr()
    code, _, err = run_cli(capsys, ["export", str(tiny_llama), "--gguf", str(tmp_path / "q.gguf"),
                                    "--outtype", "q4_k_x"])
    assert code == 2 and err.startswith("error: unknown GGUF type 'q4_k_x'; did you mean q4_k_s, q4_k_m, q5_k_s? "
                                        "choose one of f32, f16, bf16, q8_0, q4_0,")
    assert len(err.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_a_quantizer_type_without_llama_cpp_python_is_refused_in_one_line(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(extras, "_installed", lambda module: module != "llama_cpp")
    with pytest.raises(LayerpruneError, match=r"^export --outtype q5_k_m \(llama.cpp's quantizer\) needs "
                                              r"llama-cpp-python, which is not installed: pip install 'layerprune\["
                                              r"gguf-run\]'$"):
        export_gguf(tiny_llama, tmp_path / "q.gguf", "q5_k_m")
    assert list(tmp_path.iterdir()) == []


def test_a_vocabulary_llama_cpp_reads_otherwise_than_transformers_is_one_line():
    with pytest.raises(LayerpruneError, match=r"^export: llama.cpp's logits are 12 wide, transformers' 10 "):
        quantize._kl(torch.zeros(3, 10), torch.zeros(3, 12))
    assert quantize._kl(torch.zeros(3, 10), torch.zeros(3, 10)).tolist() == [0.0] * 3


def test_llama_cpp_is_closed_when_its_evaluation_fails(monkeypatch, tmp_path):
    closed = []

    class Llama:
        scores: list = []

        def __init__(self, **kwargs) -> None:  # noqa: ANN003
            pass

        def reset(self) -> None:
            pass

        def eval(self, ids: list[int]) -> None:
            raise RuntimeError("llama_decode returned -1")

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    with pytest.raises(RuntimeError, match="llama_decode"):
        quantize.llama_cpp_logits(tmp_path / "q.gguf", [[1, 2, 3]])
    assert closed == [True]
