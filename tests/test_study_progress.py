"""A study's progress packed without weights or document text, restored on a fresh machine, resumed with no finished
stage run again (pipeline/studies/progress.py)."""

from __future__ import annotations

import gzip
import io
import json
import logging
import re
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, run_cli
from layerprune.tasks.data import read_jsonl, resolve_data_dir
from test_sweep import _budget_sweep


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive, mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _ran(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The stages a run ran (not the ones it found complete), from its progress lines."""
    return [r.getMessage().split("] ", 1)[1].removesuffix(" ...") for r in caplog.records
            if r.getMessage().startswith("[") and r.getMessage().endswith(" ...")]


def test_a_studys_progress_travels_without_weights_and_resumes_without_running_a_finished_stage(
        capsys, caplog, tiny_llama, tmp_path, monkeypatch):
    """Issue 58: a study of many hours runs in parts on machines whose disks do not last. Its progress, packed without
    weights or document text, restored on a fresh machine (an empty cache, no run folder) resumes where it stood: no
    finished stage runs again but those whose weights a pending stage reads (the run that saves a checkpoint not yet
    scored, and the cut it trains), and the report equals the one of the run never interrupted."""
    from layerprune.pipeline.studies import sweep

    root = tmp_path / "sweep"
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(yaml.safe_dump(_budget_sweep(tiny_llama, root, budgets=[20, 50], arms={"lora": {
        "method": "lora"}}), sort_keys=False))
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache-a"))
    code, _, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    whole = {name: (root / name).read_text() for name in ("sweep.md", "budget.md")}
    shutil.rmtree(root)

    evaluate = sweep.evaluate  # the machine goes away while the first checkpoint is scored

    def stopped(study, settings, root, label, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if label == "lora-k1@20":
            raise KeyboardInterrupt
        return evaluate(study, settings, root, label, *args, **kwargs)

    monkeypatch.setattr(sweep, "evaluate", stopped)
    assert run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])[0] != 0
    monkeypatch.setattr(sweep, "evaluate", evaluate)
    assert (root / "eval" / "lora-k1" / "summary.json").is_file()  # the run's end scored, its checkpoint not yet
    archive = tmp_path / "kept" / "progress.tar.gz"
    code, out, err = run_cli(capsys, ["study", str(recipe), "--save-progress", str(archive)])
    assert code == 0, err
    assert f"--from-progress {archive}" in out
    members = _members(archive)
    assert not [n for n in members if n.endswith((".safetensors", ".bin", ".pt", "tokenizer.json", ".png"))]
    assert not [n for n in members if n.endswith(".jsonl") and "/samples/" not in n]  # no teacher answers
    assert not [n for n in members if n.startswith(("pruned-k1/", "lora-k1/", "lora-k1@20/", "original/"))]
    assert "pruned-k2/prune_report.json" not in members  # a later recovery trains it: made again
    assert "eval/lora-k1/summary.json" in members and "eval/pruned-k1/summary.json" in members
    text = b"".join(data for name, data in members.items() if not name.startswith("eval/baseline/")).decode()
    questions = [row["question"] for row in read_jsonl(resolve_data_dir(None) / "arc_easy" / "test.jsonl")][:200]
    assert not [q for q in questions if len(q) > 30 and q in text]  # no document text travels but the audit's items
    assert [q for q in questions if q in members["eval/baseline/samples/arc_easy.jsonl"].decode()]
    prompts = [row["instruction"] for row in read_jsonl(resolve_data_dir(None) / "dolly" / "train.jsonl")][:50]
    assert not [p for p in prompts if len(p) > 30 and p in text]
    manifest = json.loads(members["progress-manifest.json"])
    assert "eval-lora-k1" in manifest["complete"] and "recover-lora-k1" not in manifest["complete"]  # its folder stays
    assert manifest["model_hash"] and manifest["answers"]

    shutil.rmtree(root)  # a fresh machine: no run folder, an empty cache
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache-b"))
    caplog.set_level(logging.INFO, logger="layerprune")
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "--from-progress", str(archive)])
    assert code == 0, err
    ran = _ran(caplog)
    assert not {"eval-baseline", "score", "eval-pruned-k1", "eval-lora-k1"} & set(ran), ran
    assert ran[:3] == ["prune-k1", "recover-lora-k1", "eval-lora-k1@20"]
    assert {name: re.sub(r", \d+ s,", ", N s,", (root / name).read_text()) for name in whole} == {
        name: re.sub(r", \d+ s,", ", N s,", text) for name, text in whole.items()}  # the same but the wall time
    caplog.clear()  # the same command again (a scripted resume): the run resumes as it stands, nothing unpacked
    code, out, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "--from-progress", str(archive)])
    assert code == 0 and "resuming it as it stands" in out and _ran(caplog) == [], err

    saved = archive.read_bytes()
    answers = next(root / name for name in manifest["answers"] if (root / name).is_file())
    answers.write_text(answers.read_text().replace("}", ', "x": 1}', 1))  # the answers made again came out otherwise
    code, out, err = run_cli(capsys, ["study", str(recipe), "--save-progress", str(archive)])
    assert_one_line_error(code, err, "trained on other answers")
    assert archive.read_bytes() == saved  # nothing written


def test_a_resume_on_other_weights_or_another_recipes_progress_is_refused(capsys, tiny_llama, tmp_path, monkeypatch):
    """The weights a run's evaluations scored are the ones it resumes on (a variant made again otherwise on another
    machine would mix two models); another recipe's progress, or a run folder that holds one, is refused untouched."""
    root = tmp_path / "sweep"
    data = _budget_sweep(tiny_llama, root, budgets=[20, 50], arms={"lora": {"method": "lora"}})
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    (root / "eval" / "baseline").mkdir(parents=True)  # a run whose baseline evaluation scored other weights
    from layerprune.core.errors import LayerpruneError
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies.progress import check_same_weights
    from layerprune.pipeline.studies.sweep_grid import SweepStudy

    study = SweepStudy.model_validate(data)
    (root / "eval" / "baseline" / "summary.json").write_text(json.dumps({"model_hash": "f" * 64}))
    with pytest.raises(LayerpruneError, match="would mix two models"):
        check_same_weights(study, RunSettings(), root)
    from layerprune.models.identity import model_fingerprint
    from layerprune.models.loading import resolve_model

    same = model_fingerprint(resolve_model(study.model, RunSettings()), RunSettings().resolved_cache_dir())
    (root / "eval" / "baseline" / "summary.json").write_text(json.dumps({"model_hash": same}))
    check_same_weights(study, RunSettings(), root)

    archive = tmp_path / "other.tar.gz"
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        body = json.dumps({"format": 1, "study": "other", "fingerprint": "0123"}).encode()
        info = tarfile.TarInfo("progress-manifest.json")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    archive.write_bytes(buffer.getvalue())
    code, _, err = run_cli(capsys, ["study", str(recipe), "--from-progress", str(archive)])
    assert_one_line_error(code, err, "not of tiny-sweep")
    shutil.rmtree(root)
    code, _, err = run_cli(capsys, ["study", str(recipe), "--from-progress", str(archive)])
    assert_one_line_error(code, err, "not of tiny-sweep")
    assert not root.exists()
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tar")
    code, _, err = run_cli(capsys, ["study", str(recipe), "--from-progress", str(tmp_path / "junk.tar.gz")])
    assert_one_line_error(code, err, "not a study's progress")
    code, _, err = run_cli(capsys, ["study", str(recipe), "--save-progress", str(tmp_path / "p.tar.gz")])
    assert_one_line_error(code, err, "no run.json")
    assert not (tmp_path / "p.tar.gz").exists()
