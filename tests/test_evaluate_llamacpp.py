"""evaluate --backend llamacpp: a GGUF scored by llama.cpp itself gives the same per-document log-likelihoods and
greedy answers as transformers on the directory it was exported from (f32: no quantization between them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from helpers import run_cli
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.evaluate.runner import evaluate_model
from layerprune.evaluate.schema import EvalSettings
from layerprune.export import export_gguf
from test_export import gguf_sourced  # noqa: F401  (the fixture: a tiny llama with SmolLM2's vocabulary)

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="--backend llamacpp needs llama-cpp-python (make bench-engines builds it)")


@pytest.fixture(scope="module")
def exported(gguf_sourced, tmp_path_factory) -> Path:  # noqa: F811
    path = tmp_path_factory.mktemp("llamacpp") / "tiny.f32.gguf"
    export_gguf(gguf_sourced, path, "f32", verify=False)
    return path


def _samples(summary_dir: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (summary_dir / "samples" / f"{task}.jsonl").read_text().splitlines()]


@needs_llama_cpp
def test_llama_cpp_scores_each_document_as_transformers_does(gguf_sourced, exported, shared_data,  # noqa: F811
                                                             tmp_path):
    run = RunSettings(device="cpu", dtype="float32", cache_dir=tmp_path / "cache")
    common = {"tasks": ["arc_easy", "copy_l3"], "limit": 4, "data_dir": shared_data}
    hf = evaluate_model(gguf_sourced, EvalSettings(**common), run, tmp_path / "hf")
    cpp = evaluate_model(exported, EvalSettings(**common, backend="llamacpp"), run, tmp_path / "cpp")
    assert cpp.model.kind == "gguf-llamacpp" and cpp.model_hash != hf.model_hash
    choice_hf, choice_cpp = _samples(tmp_path / "hf", "arc_easy"), _samples(tmp_path / "cpp", "arc_easy")
    assert [s["doc_id"] for s in choice_hf] == [s["doc_id"] for s in choice_cpp]
    for a, b in zip(choice_hf, choice_cpp, strict=True):  # every choice's log-likelihood, not just the accuracy
        expected = [float(r[0]) for r in a["filtered_resps"]]
        found = [float(r[0]) for r in b["filtered_resps"]]
        assert found == pytest.approx(expected, abs=2e-3)
        assert a["acc"] == b["acc"]
    generated_hf, generated_cpp = _samples(tmp_path / "hf", "copy_l3"), _samples(tmp_path / "cpp", "copy_l3")
    assert [s["resps"] for s in generated_cpp] == [s["resps"] for s in generated_hf]


@needs_llama_cpp
def test_the_ggufs_chat_template_renders_as_transformers_renders_it(gguf_sourced, exported):  # noqa: F811
    from layerprune.evaluate.llamacpp_lm import LlamaCppLM

    lm = LlamaCppLM(exported, threads=1, n_ctx=256)
    chat = [{"role": "user", "content": "2 + 2 ="}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3 + 3 ="}]
    expected = AutoTokenizer.from_pretrained(gguf_sourced).apply_chat_template(chat, tokenize=False,
                                                                               add_generation_prompt=True)
    assert lm.apply_chat_template(chat) == expected
    assert lm.tok_encode(expected) == AutoTokenizer.from_pretrained(gguf_sourced)(expected)["input_ids"]
    with pytest.raises(LayerpruneError, match="greedily"):
        lm._generate("2 + 2 =", {"until": ["\n"], "do_sample": True, "temperature": 0.7})


def test_a_model_that_is_not_a_gguf_file_is_refused_in_one_line(gguf_sourced, capsys, tmp_path):  # noqa: F811
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(gguf_sourced), "--backend", "llamacpp",
                                    "--tasks", "arc_easy", "--limit", "1", "--output", str(tmp_path / "out")])
    assert code != 0 and "--backend llamacpp scores a .gguf file" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@needs_llama_cpp
def test_two_gguf_files_are_compared_paired_without_converting_either(gguf_sourced, exported, shared_data,  # noqa: F811
                                                                       capsys, tmp_path, monkeypatch):
    import layerprune.models.loading as loading

    quantized = tmp_path / "tiny.q8_0.gguf"
    export_gguf(gguf_sourced, quantized, "q8_0", verify=False)
    monkeypatch.setattr(loading, "convert_gguf", lambda *a: pytest.fail("a GGUF was converted for transformers"))
    code, out, err = run_cli(capsys, ["evaluate", "--backend", "llamacpp", "--baseline", str(exported),
                                      "--model", str(quantized), "--tasks", "arc_easy", "--limit", "3",
                                      "--data-dir", str(shared_data), "--cache-dir", str(tmp_path / "cache"),
                                      "--output", str(tmp_path / "cmp")])
    assert code == 0, err
    assert (tmp_path / "cmp" / "comparison.md").is_file() and "arc_easy" in out
    assert "different tokenizer" not in err  # the two files' token lists, read from the GGUFs, are the same
