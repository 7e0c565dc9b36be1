"""`prune` end to end on tiny models, and every bad input: one-line error, exit 2, input untouched, no output."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, BertConfig, BertModel

from helpers import assert_one_line_error, fingerprint, run_cli
from tiny import tiny_tokenizer


@pytest.fixture
def model_copy(tiny_llama, tmp_path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_llama, target)
    return target


def prune_args(model: Path, output: Path, *extra: str) -> list[str]:
    return ["prune", "--model", str(model), "--output", str(output), "--calib", "arithmetic",
            "--calib-samples", "8", "--batch-size", "4", *extra]


def test_prune_writes_a_complete_model_directory(capsys, model_copy, tmp_path):
    out = tmp_path / "pruned"
    code, stdout, err = run_cli(capsys, prune_args(model_copy, out, "--drop", "2", "--score", "ablation"))
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    assert report["num_blocks_before"] == 6 and report["num_blocks_after"] == 4
    assert len(report["dropped"]) == 2 and 0 not in report["dropped"]
    assert len(report["scores"]) == 6 and all(s is not None for s in report["scores"])
    assert report["calibration"]["samples"] == 8 and report["provenance"]["versions"]["transformers"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md",
                 "block_scores.png"):
        assert (out / name).is_file(), name
    assert "chat_template" in (out / "tokenizer_config.json").read_text() or (out / "chat_template.jinja").is_file()
    assert f"output: {out}" in stdout and str(report["dropped"]) in stdout
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 4
    assert not list(tmp_path.glob(".pruned.tmp-*"))


@pytest.mark.parametrize("score", ["block-influence", "angular", "taylor", "last", "random"])
def test_every_score_prunes(capsys, tiny_llama, tmp_path, score):
    out = tmp_path / score
    code, _, err = run_cli(capsys, prune_args(tiny_llama, out, "--drop", "2", "--score", score))
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    assert report["method"]["score"] == score and len(report["dropped"]) == 2
    if score == "angular":
        assert report["dropped"][1] - report["dropped"][0] == 1
    if score == "last":
        assert report["dropped"] == [4, 5]


def test_same_seed_same_blocks(capsys, tiny_llama, tmp_path):
    reports = []
    for name in ("a", "b"):
        code, _, err = run_cli(capsys, prune_args(tiny_llama, tmp_path / name, "--drop", "2", "--dry-run", "--json"))
        assert code == 0, err
        reports.append(json.loads(_.split("dry run: nothing written\n", 1)[1]))
    assert reports[0]["scores"] == reports[1]["scores"]
    assert reports[0]["dropped"] == reports[1]["dropped"]
    assert not (tmp_path / "a").exists()


def test_iterative_ablation_drops_in_greedy_order(capsys, tiny_llama, tmp_path):
    out = tmp_path / "it"
    code, _, err = run_cli(capsys, prune_args(tiny_llama, out, "--drop", "3", "--iterative"))
    assert code == 0, err
    report = json.loads((out / "prune_report.json").read_text())
    assert len(report["steps"]) == 3
    assert sorted(step["dropped"] for step in report["steps"]) == report["dropped"]
    assert [len(step["deltas"]) for step in report["steps"]] == [5, 4, 3]  # block 0 protected


def test_accuracy_metric_runs_on_probes(capsys, tiny_llama, tmp_path):
    code, _, err = run_cli(capsys, prune_args(tiny_llama, tmp_path / "acc", "--drop", "1", "--metric", "accuracy",
                                              "--max-new-tokens", "3"))
    assert code == 0, err


def test_explicit_layers_and_protect_last(capsys, tiny_llama, tmp_path):
    out = tmp_path / "layers"
    code, _, err = run_cli(capsys, prune_args(tiny_llama, out, "--layers", "2,4", "--protect", "0,-1"))
    assert code == 0, err
    assert json.loads((out / "prune_report.json").read_text())["kept"] == [0, 1, 3, 5]


BAD_FLAGS = [
    (["--drop", "0"], "drop"),
    (["--drop", "-2"], "drop"),
    (["--drop", "6"], "protected"),
    (["--layers", "1,1"], "more than once"),
    (["--layers", "2,9"], "outside"),
    (["--drop", "3", "--layers", "1,2"], "disagrees"),
    (["--drop", "2", "--score", "ablaton"], "did you mean: ablation"),
    (["--layers", "0,1"], "protected"),
    (["--drop", "1", "--protect", "7"], "outside"),
]


@pytest.mark.parametrize(("flags", "needle"), BAD_FLAGS)
def test_bad_flags(capsys, model_copy, tmp_path, flags, needle):
    before = fingerprint(model_copy)
    code, _, err = run_cli(capsys, prune_args(model_copy, tmp_path / "out", *flags))
    assert_one_line_error(code, err, needle)
    assert fingerprint(model_copy) == before
    assert not (tmp_path / "out").exists()


def test_missing_model_path(capsys, tmp_path):
    code, _, err = run_cli(capsys, prune_args(tmp_path / "nope", tmp_path / "out", "--drop", "1"))
    assert_one_line_error(code, err, "not found")


def test_encoder_only_model_is_refused(capsys, tmp_path):
    bert = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=384, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(bert)
    tiny_tokenizer().save_pretrained(bert)
    code, _, err = run_cli(capsys, prune_args(bert, tmp_path / "out", "--drop", "1"))
    assert_one_line_error(code, err, "not a decoder-only")
    assert not (tmp_path / "out").exists()


def test_pickle_only_checkpoint_is_refused(capsys, model_copy, tmp_path):
    import torch

    state = AutoModelForCausalLM.from_pretrained(model_copy).state_dict()
    (model_copy / "model.safetensors").unlink()
    torch.save(state, model_copy / "pytorch_model.bin")
    before = fingerprint(model_copy)
    code, _, err = run_cli(capsys, prune_args(model_copy, tmp_path / "out", "--drop", "1"))
    assert_one_line_error(code, err, "pickle")
    assert fingerprint(model_copy) == before


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_is_refused(capsys, model_copy, tmp_path, damage):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    garbage = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else garbage)
    code, _, err = run_cli(capsys, prune_args(model_copy, tmp_path / "out", "--drop", "1"))
    assert_one_line_error(code, err, "safetensors")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "needle"),
    [("", "empty"), ('{"text": "a"}\n{oops\n', "not valid json"), ('{"question": "x"}\n', "expected a 'text' field")],
)
def test_bad_calibration_file(capsys, model_copy, tmp_path, content, needle):
    calib = tmp_path / "calib.jsonl"
    calib.write_text(content)
    args = prune_args(model_copy, tmp_path / "out", "--drop", "1")
    args[args.index("arithmetic")] = str(calib)
    code, _, err = run_cli(capsys, args)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(capsys, model_copy, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, prune_args(model_copy, out, "--drop", "1"))
    assert_one_line_error(code, err, "already exists", "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"


def test_output_that_is_the_input_is_refused(capsys, model_copy):
    before = fingerprint(model_copy)
    code, _, err = run_cli(capsys, prune_args(model_copy, model_copy, "--drop", "1", "--overwrite"))
    assert_one_line_error(code, err, "is the input")
    assert fingerprint(model_copy) == before


def test_full_disk_during_save_leaves_nothing(capsys, model_copy, tmp_path, monkeypatch):
    import transformers.modeling_utils as modeling_utils

    def no_space(tensors, filename, *args, **kwargs):  # noqa: ANN001, ANN202
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    import layerprune.models.safetensors_copy as safetensors_copy

    def no_space_left(fd, data, offset):  # noqa: ANN001, ANN202
        os.pwrite(fd, data[:7], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(modeling_utils, "safe_save_file", no_space)
    monkeypatch.setattr(safetensors_copy, "_write_all", no_space_left)  # the streamed save: byte copies
    code, _, err = run_cli(capsys, prune_args(model_copy, tmp_path / "out", "--drop", "1"))
    assert_one_line_error(code, err, "no space left")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_import_evaluate_is_hugging_face_evaluate():
    import evaluate

    assert hasattr(evaluate, "load")
    assert "layerprune" not in str(Path(evaluate.__file__))
