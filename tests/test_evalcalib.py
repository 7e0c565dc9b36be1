"""Honest evaluation: calibration never sees an evaluated item, reports know their noise, bad data fails early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, run_cli
from layerprune.evaluate.project_tasks import probe_config
from layerprune.evaluate.registry import TASKS
from layerprune.prune.calib import arithmetic_calib

GSM_TEST = [{"question": f"Tom has {i} apples and buys {i + 2} more at the market. How many now?",
             "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"} for i in range(8)]
GSM_TRAIN = [{"question": f"Ann reads {i} pages a day for a whole week long. How many pages?",
              "answer": f"7 * {i} = {7 * i}\n#### {7 * i}"} for i in range(8)]


def write_rows(root: Path, dataset: str, split: str, rows: list[dict]) -> None:
    (root / dataset).mkdir(parents=True, exist_ok=True)
    (root / dataset / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def gsm_dir(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    write_rows(root, "gsm8k", "test", GSM_TEST)
    write_rows(root, "gsm8k", "train", GSM_TRAIN)
    return root


def eval_questions(task: str, seed: int = 0) -> set[str]:
    """The question lines of a probe task's evaluation items (what follows the few-shot prefix)."""
    rows = probe_config(TASKS.get(task), seed)["custom_dataset"]()["test"]
    return {row["prompt"].splitlines()[-1] for row in rows}


# 1. calibration never sees an evaluation item ---------------------------------------------------------------

@pytest.mark.parametrize("seed,count", [(0, 16), (0, 300), (3, 64), (11, 200)])
def test_generated_calibration_never_holds_an_evaluation_probe(seed, count):
    evaluated = set().union(*(eval_questions(t) for t in TASKS.names() if t.startswith("arith_")))
    calib = arithmetic_calib(count, seed, None)
    assert len(calib.items) == count
    lines = {line.rsplit("=", 1)[0] + "=" for item in calib.items for line in item.prompt.splitlines()}
    assert not lines & evaluated  # neither a question nor a few-shot example of calibration is evaluated
    assert len({item.prompt.splitlines()[-1] for item in calib.items}) == count  # distinct questions


def prune_tiny(capsys, model: Path, output: Path, calib: str, data_dir: Path, samples: int = 6) -> dict:
    code, _, err = run_cli(capsys, ["prune", "--model", str(model), "--output", str(output), "--calib", calib,
                                    "--calib-samples", str(samples), "--batch-size", "4", "--drop", "1",
                                    "--data-dir", str(data_dir)])
    assert code == 0, err
    return json.loads((output / "prune_report.json").read_text())


def test_prune_report_lists_items_and_the_auto_fallback(capsys, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    report = prune_tiny(capsys, tiny_llama, tmp_path / "p", "auto", tmp_path / "empty", samples=5)
    calibration = report["calibration"]
    assert "GSM8K train not reachable" in calibration["fallback"]
    assert len(calibration["items"]) == 5
    expected = arithmetic_calib(5, 0, None).items
    assert [(i["prompt"], i["answer"]) for i in calibration["items"]] == [(e.prompt, e.answer) for e in expected]


@pytest.fixture
def leaky_prune(capsys, tiny_llama, tmp_path, gsm_dir) -> Path:
    """A model pruned on a JSONL calibration file that copies 5 GSM8K test questions (and 3 train ones)."""
    rows = [{"prompt": f"Question: {r['question']}\nAnswer:", "answer": " " + r["answer"]}
            for r in GSM_TEST[1:6] + GSM_TRAIN[:3]]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prune_tiny(capsys, tiny_llama, tmp_path / "leaky", str(calib), gsm_dir, samples=8)
    return tmp_path / "leaky"


EVAL_FLAGS = ["--tasks", "gsm8k,arith_1dc", "--limit", "8", "--num-fewshot", "0", "--max-gen-toks", "2"]


def test_evaluating_on_calibration_items_is_refused(capsys, leaky_prune, tiny_llama, tmp_path, gsm_dir):
    common = [*EVAL_FLAGS, "--data-dir", str(gsm_dir), "--cache-dir", str(tmp_path / "c")]
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(leaky_prune), *common, "--output", str(tmp_path / "a")])
    assert_one_line_error(code, err, "gsm8k (5 documents)", "--allow-overlap")
    assert "arith_1dc" not in err
    code, _, err = run_cli(capsys, ["evaluate", "--baseline", str(tiny_llama), "--pruned", str(leaky_prune),
                                    "--model", str(leaky_prune), *common, "--output", str(tmp_path / "b")])
    assert_one_line_error(code, err, "gsm8k (5 documents)")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(leaky_prune), *common, "--limit", "1",
                                    "--output", str(tmp_path / "d")])
    assert code == 0, err  # only the first document is evaluated, and calibration did not copy it
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(leaky_prune), *common, "--allow-overlap",
                                    "--output", str(tmp_path / "e")])
    assert code == 0, err
    recorded = json.loads((tmp_path / "e" / "summary.json").read_text())["calibration_overlap"]
    assert recorded["allowed"] is True and recorded["tasks"] == {"gsm8k": 5}


def test_run_refuses_overlap_before_evaluating(capsys, tiny_llama, tmp_path, gsm_dir):
    rows = [{"text": f"Question: {r['question']}\nAnswer: {r['answer']}"} for r in GSM_TEST[:5]]
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {"name": "leak", "model": str(tiny_llama), "output": str(tmp_path / "run"), "recover": None,
              "prune": {"drop": 1, "calib": str(calib), "calib_samples": 5, "data_dir": str(gsm_dir)},
              "evaluate": {"tasks": ["gsm8k"], "limit": 8, "num_fewshot": 0, "max_gen_toks": 2,
                           "data_dir": str(gsm_dir)}}
    path = tmp_path / "leak.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, _, err = run_cli(capsys, ["run", str(path), "--cache-dir", str(tmp_path / "c")])
    assert_one_line_error(code, err, "gsm8k (5 documents)")
    assert not (tmp_path / "run" / "eval").exists()
    code, _, err = run_cli(capsys, ["run", str(path), "--cache-dir", str(tmp_path / "c"), "--allow-overlap"])
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "eval" / "pruned" / "summary.json").read_text())
    assert summary["calibration_overlap"]["tasks"] == {"gsm8k": 5} and summary["calibration_overlap"]["allowed"]
