"""An unexpected error inside a library ends in one line naming the stage and the exception; the traceback is
kept in the run's folder (or shown with --debug)."""

from __future__ import annotations

import pytest

from layerprune.cli import main
from layerprune.cli import prune as prune_cli
from layerprune.core import errors


def _raise_inside_a_library(args):  # as transformers' padded-batch attention rejected a DeepSeek-V3 config
    with errors.stage("prune (scoring)"):
        raise ValueError("Attention mask should be of size (2, 1, 7, 7),\n but is (2, 1, 7, 9)")


def test_an_unexpected_error_is_one_line_naming_the_stage_with_the_traceback_kept(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(prune_cli, "run", _raise_inside_a_library)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["prune", "--model", "m", "-o", str(out)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: prune (scoring) failed: ValueError: Attention mask")
    kept = list(out.glob("traceback-prune-*.txt"))
    assert kept and "Traceback" in kept[0].read_text() and str(kept[0]) in lines[0]


def test_without_a_run_folder_the_traceback_goes_to_the_cache(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(prune_cli, "run", _raise_inside_a_library)
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    assert main(["prune", "--model", "m"]) == 1
    assert list((tmp_path / "cache" / "errors").glob("traceback-prune-*.txt"))
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setattr(prune_cli, "run", _raise_inside_a_library)
    with pytest.raises(ValueError, match="Attention mask"):
        main(["prune", "--debug", "--model", "m"])


def test_user_errors_keep_their_one_line_and_code_two(monkeypatch, capsys):
    def bad(args):
        with errors.stage("prune"):
            raise errors.LayerpruneError("model path not found: m")

    monkeypatch.setattr(prune_cli, "run", bad)
    assert main(["prune", "--model", "m"]) == 2
    assert capsys.readouterr().err.strip() == "error: model path not found: m"
