"""Bad input ends in one line, with the input untouched and nothing half-written: an output that is (or holds) an
input is refused by every command that replaces its output, a checkpoint that lacks weights its config needs is not
loaded with random ones, and library failures at the edges (a binary recipe, a duplicate key, an output under a
file, a CUDA device on a machine without one, a closed pipe) are a line, not a traceback (found by a CLI audit)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import assert_one_line_error, run_cli


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def digest(path: Path) -> str:
    """sha256 over a file, or over every file of a folder (names and bytes)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    sha = hashlib.sha256()
    for file in files:
        sha.update(str(file.relative_to(path.parent)).encode() + file.read_bytes())
    return sha.hexdigest()


@pytest.fixture
def model_copy(tiny_llama, tmp_path) -> Path:
    """A copy of tiny_llama in its own folder, so a command that wrongly replaces it harms nothing else."""
    copy = tmp_path / "inputs" / "model"
    shutil.copytree(tiny_llama, copy)
    return copy


@pytest.mark.parametrize("where", ["model", "parent"])
def test_run_refuses_an_output_that_is_or_holds_its_model(capsys, model_copy, where):
    """`run --output MODEL --overwrite` deleted the model before its first stage."""
    before = digest(model_copy)
    output = model_copy if where == "model" else model_copy.parent
    code, _, err = run_cli(capsys, ["run", "demo", "--model", str(model_copy), "-o", str(output), "--overwrite"])
    assert_one_line_error(code, err, "is the input")
    assert digest(model_copy) == before


def test_evaluate_refuses_an_output_that_is_its_model(capsys, model_copy):
    before = digest(model_copy)
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(model_copy), "-o", str(model_copy), "--overwrite",
                                    "--tasks", "arith_1dc", "--limit", "2"])
    assert_one_line_error(code, err, "is the input")
    assert digest(model_copy) == before


def test_evaluate_of_roles_refuses_an_output_holding_one_of_them(capsys, model_copy, tiny_llama):
    code, _, err = run_cli(capsys, ["evaluate", "--baseline", str(tiny_llama), "--pruned", str(model_copy), "-o",
                                    str(model_copy.parent), "--overwrite", "--tasks", "arith_1dc", "--limit", "2"])
    assert_one_line_error(code, err, "is the input")
    assert (model_copy / "config.json").is_file()


def test_analyze_refuses_an_output_holding_its_generations(capsys, tmp_path):
    generations = tmp_path / "d" / "gen.jsonl"
    generations.parent.mkdir()
    generations.write_text('{"prompt": "p", "output": "one two one two."}\n')
    code, _, err = run_cli(capsys, ["analyze", "degeneration", "--generations", str(generations), "--output",
                                    str(generations.parent), "--overwrite"])
    assert_one_line_error(code, err, "is the input")
    assert generations.read_text() == '{"prompt": "p", "output": "one two one two."}\n'


@pytest.mark.parametrize("name", ["", ".", "..", "../escape", "a/b"])
def test_a_recipe_name_that_is_not_a_folder_name_is_refused_before_anything_is_deleted(capsys, tmp_path,
                                                                                      monkeypatch, tiny_llama,
                                                                                      name):
    """name: "" made the run folder runs/ itself: `--overwrite` deleted every other run."""
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "runs" / "other" / "run.json"
    other.parent.mkdir(parents=True)
    other.write_text("{}")
    recipe = write_yaml(tmp_path / "r.yaml", {"name": name, "model": str(tiny_llama), "recover": None,
                                              "prune": {"drop": 1, "score": "last"},
                                              "evaluate": {"tasks": ["arith_1dc"], "limit": 2}})
    code, _, err = run_cli(capsys, ["run", str(recipe), "--overwrite", "--from", "bogus"])
    assert_one_line_error(code, err, "not a plain folder name")
    assert other.read_text() == "{}"


def test_run_from_an_unknown_stage_writes_nothing(capsys, tiny_llama, tmp_path):
    output = tmp_path / "run"
    code, _, err = run_cli(capsys, ["run", "demo", "--model", str(tiny_llama), "-o", str(output), "--from",
                                    "bogus"])
    assert_one_line_error(code, err, "unknown stage")
    assert not output.exists()


def test_records_report_leaves_no_folder_for_an_archive_it_cannot_read(capsys, tmp_path):
    fake = tmp_path / "fake.tar.gz"
    fake.write_bytes(b"not an archive")
    code, _, err = run_cli(capsys, ["records", "report", str(fake), "-o", str(tmp_path / "rep")])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("how", ["truncated", "config"])
def test_a_checkpoint_that_lacks_weights_its_config_needs_is_not_loaded(tmp_path, model_copy, how):
    """transformers starts missing weights at random and goes on; evaluate then scored a half-random model."""
    from safetensors.torch import load_file, save_file

    from layerprune.core.errors import LayerpruneError
    from layerprune.models.loading import load_model

    if how == "truncated":
        weights = load_file(model_copy / "model.safetensors")
        save_file({k: v for k, v in weights.items() if ".layers.3." not in k}, model_copy / "model.safetensors",
                  metadata={"format": "pt"})
    else:  # a config that names more blocks than the checkpoint holds
        config = json.loads((model_copy / "config.json").read_text())
        (model_copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    with pytest.raises(LayerpruneError, match="its checkpoint lacks .* weights its config needs"):
        load_model(str(model_copy))


def test_recipe_files_that_are_binary_or_name_a_key_twice_are_one_line(capsys, tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81 not text")
    code, _, err = run_cli(capsys, ["prune", "--recipe", str(binary), "--model", "embedded", "--dry-run"])
    assert_one_line_error(code, err, "not a text file")
    twice = tmp_path / "twice.yaml"
    twice.write_text("score: last\ndrop: 3\ndrop: 4\n")
    code, _, err = run_cli(capsys, ["prune", "--recipe", str(twice), "--model", "embedded", "--dry-run"])
    assert_one_line_error(code, err, "the key 'drop' is given twice")
    merged = tmp_path / "merged.yaml"  # YAML merge keys still override: not a key given twice
    merged.write_text("a: &A {x: 1}\nb:\n  <<: *A\n  x: 2\n")
    from layerprune.core.recipe_loading import read_recipe_dict

    assert read_recipe_dict(merged) == {"a": {"x": 1}, "b": {"x": 2}}


def test_an_output_under_a_file_is_refused_before_the_model_loads(capsys, tiny_llama, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    code, _, err = run_cli(capsys, ["prune", "--model", str(tiny_llama), "--layers", "2", "-o",
                                    str(blocker / "sub")])
    assert_one_line_error(code, err, "is a file, not a folder")
    assert blocker.read_text() == "x"


def test_an_output_that_cannot_be_made_is_one_line(tmp_path):
    from layerprune.core.errors import LayerpruneError
    from layerprune.core.outputs import atomic_output_dir

    with pytest.raises(LayerpruneError, match="cannot make output"):
        with atomic_output_dir(Path("/proc/layerprune-test/out")):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_one_is_one_line(capsys, tiny_llama, tmp_path):
    code, _, err = run_cli(capsys, ["prune", "--model", str(tiny_llama), "--layers", "2", "-o",
                                    str(tmp_path / "p"), "--device", "cuda"])
    assert_one_line_error(code, err, "sees no CUDA device")
    assert not (tmp_path / "p").exists()


def test_a_reader_that_goes_away_is_no_error(tmp_path):
    """`layerprune recipes list | head -1` ended in "recipes failed: BrokenPipeError" and a saved traceback."""
    env = {**os.environ, "LAYERPRUNE_CACHE": str(tmp_path / "cache")}
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        done = subprocess.run([sys.executable, "-m", "layerprune.cli", "recipes", "list"], stdout=write,
                              stderr=subprocess.PIPE, env=env, timeout=120, check=False)
    finally:
        os.close(write)
    assert done.stderr == b"" and done.returncode == 141, done.stderr  # 128 + SIGPIPE, as a shell reports it
    assert not (tmp_path / "cache" / "errors").exists()


def test_export_refuses_to_write_over_its_source_gguf(monkeypatch, tmp_path, tiny_llama):
    from layerprune.core.errors import LayerpruneError
    from layerprune.export import api

    source = tmp_path / "source.gguf"
    source.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setattr(api, "source_gguf", lambda directory, settings=None: source)
    with pytest.raises(LayerpruneError, match="is the GGUF the tokenizer is read from"):
        api.export_gguf(tiny_llama, source, "f32", overwrite=True)
    assert source.read_bytes() == b"GGUF" + b"\0" * 60


def test_lm_evals_git_lookup_says_nothing_outside_a_git_work_tree(monkeypatch, tmp_path, capfd):
    """evaluate printed git's "fatal: not a git repository" on stderr, even with -q, outside a git work tree."""
    from lm_eval import evaluator

    from layerprune.evaluate import lm_eval_env

    monkeypatch.setattr(lm_eval_env, "_RECORDS", {})
    monkeypatch.setattr(evaluator, "add_env_info", evaluator.add_env_info)  # put back after the test
    monkeypatch.setattr(evaluator, "get_git_commit_hash", evaluator.get_git_commit_hash)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no git tree above tmp_path either
    lm_eval_env.record_once()
    assert evaluator.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err


def test_a_usage_error_is_one_line(capsys):
    """argparse printed its usage block (16-45 lines) before the error."""
    from layerprune.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["prune", "--drop", "x"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.strip().splitlines() == [
        "error: argument --drop: invalid int value: 'x' (`layerprune prune --help` lists the options)"]


def test_runs_dry_run_refuses_what_the_run_would(capsys, model_copy, tmp_path):
    """`run --dry-run` said all was well for an output the run itself would refuse (or delete the model for)."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    for output, words in ((model_copy, "is the input"), (blocker / "x", "is a file, not a folder"),
                          (blocker, "not a directory")):
        code, _, err = run_cli(capsys, ["run", "demo", "--model", str(model_copy), "-o", str(output), "--dry-run"])
        assert_one_line_error(code, err, words)
    code, _, err = run_cli(capsys, ["run", "demo", "--model", str(model_copy), "-o", str(tmp_path / "r"),
                                    "--from", "bogus", "--dry-run"])
    assert_one_line_error(code, err, "unknown stage")
