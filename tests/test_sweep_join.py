"""`layerprune analyze sweeps`: sweeps of one model and cut that recovered differently, compared arm by arm on the
items every run scored (pipeline/studies/sweep_join.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import assert_one_line_error, run_cli
from layerprune.core.errors import LayerpruneError

N = 60  # items a task in the first sweep; the second scored the first 40 of the same list


def _eval(folder: Path, scores: dict[str, list[float]], model_hash: str) -> None:
    """A synthetic eval folder: summary.json and samples/TASK.jsonl (piqa classification, copy_l7 generative)."""
    from layerprune.evaluate import Summary, TaskResult

    (folder / "samples").mkdir(parents=True)
    results = []
    for task, values in scores.items():
        kind = "classification" if task == "piqa" else "generative"
        metric = "acc" if kind == "classification" else "exact_match"
        with (folder / "samples" / f"{task}.jsonl").open("w") as handle:
            for i, value in enumerate(values):
                handle.write(json.dumps({"doc_id": i, "filter": "none", metric: value, "doc_hash": f"d{i}",
                                         "prompt_hash": f"p{i}", "arguments": [["q", "a"], ["q", "b"]]}) + "\n")
        results.append(TaskResult(task=task, kind=kind, metric=metric, value=float(np.mean(values)), stderr=None,
                                  n=len(values), headline=True, settings={}, seconds=1.0))
    summary = Summary(model={"spec": "x", "location": "x", "kind": "local"}, model_hash=model_hash, results=results)
    (folder / "summary.json").write_text(summary.model_dump_json())


def _sweep(root: Path, name: str, arm: str | None, won: dict[int, list[int]], n: int = N,
           pruned_hash: str = "pruned") -> Path:
    """A finished sweep at k = 1: the original answers the first 45 copy items, pruning loses them all, replicate r
    of the recovery at k wins back won[k][r] of them (k = 0: the control keeps won[0][r] of the 45)."""
    rng = np.random.default_rng(0)
    cls = (rng.random(N) < 0.7).astype(float)[:n].tolist()
    gen = np.r_[np.ones(45), np.zeros(N - 45)][:n]
    models = {"baseline": ("original", gen), "pruned-k1": (pruned_hash, np.zeros(n))}
    prefix = arm or "recovered"
    for k, runs in won.items():
        for r, count in enumerate(runs):
            scores = np.zeros(n)
            scores[:count] = 1
            models[f"{prefix}-k{k}" + (f"@r{r}" if r else "")] = (f"{prefix}{k}{r}", scores)
    for label, (model_hash, scores) in models.items():
        _eval(root / "eval" / label, {"piqa": cls, "copy_l7": scores.tolist()}, model_hash)
    root.joinpath("sweep.json").write_text(json.dumps({"replicates": len(won[1]),
                                                       **({"arms": {arm: "lora"}} if arm else {})}))
    root.joinpath("run.json").write_text(json.dumps({"recipe": {"name": name}}))
    return root


def test_two_sweeps_pair_their_arms_on_the_items_both_scored(tmp_path):
    from layerprune.pipeline.studies import sweep_join

    generic = _sweep(tmp_path / "a", "generic", "sft-dolly", {0: [45, 44, 45], 1: [10, 12, 11]})
    aligned = _sweep(tmp_path / "b", "aligned", None, {0: [30, 35, 40], 1: [30, 33, 36]}, n=40)
    data, text = sweep_join.compare([generic, aligned])
    assert data["items"] == {"piqa": 40, "copy_l7": 40} and data["ratios"] == [1]
    assert data["models"]["aligned-k1@r2"] == str(aligned / "eval" / "recovered-k1@r2")  # a sweep without arms
    share = {p["arm"]: p["generative"]["recovered_share"]["value"] for p in data["points"]}
    assert share["sft-dolly"] == pytest.approx(11 / 40) and share["aligned"] == pytest.approx(33 / 40)
    (pair,) = data["comparisons"]
    assert pair["arms"] == ["sft-dolly", "aligned"] and pair["generative"]["share_status"] == "contradicted"
    assert data["controls"]["aligned"]["generative"]["change"]["value"] == pytest.approx(-5 / 40)
    assert any("sft-dolly - aligned at k = 1, generative: recovered share" in line for line in text)


def test_sweeps_of_other_weights_or_one_arm_name_twice_are_refused(tmp_path):
    from layerprune.pipeline.studies import sweep_join

    first = _sweep(tmp_path / "a", "generic", "sft", {0: [45], 1: [10]})
    other = _sweep(tmp_path / "b", "aligned", "sft-gsm8k", {0: [45], 1: [20]}, pruned_hash="another cut")
    with pytest.raises(LayerpruneError, match=r"pruned-k1 of .*b is not pruned-k1 of .*a \(model hash"):
        sweep_join.compare([first, other])
    twin = _sweep(tmp_path / "c", "again", "sft", {0: [45], 1: [20]})
    with pytest.raises(LayerpruneError, match="arm 'sft' is in both"):
        sweep_join.compare([first, twin])
    with pytest.raises(LayerpruneError, match="no sweep.json: not a sweep study's folder"):
        sweep_join.compare([first, tmp_path])


def test_the_cli_writes_the_comparison_and_a_refusal_leaves_nothing(tmp_path, capsys):
    a = _sweep(tmp_path / "a", "generic", "sft-dolly", {0: [45], 1: [10]})
    b = _sweep(tmp_path / "b", "aligned", "sft-gsm8k", {0: [45], 1: [30]})
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, ["analyze", "sweeps", "--runs", str(a), str(b), "-o", str(out)])
    assert code == 0, err
    assert (out / "sweeps.json").is_file() and "# Sweeps compared: generic, aligned" in stdout
    bad = tmp_path / "bad"
    code, stdout, err = run_cli(capsys, ["analyze", "sweeps", "--runs", str(a), str(tmp_path), "-o", str(bad)])
    assert_one_line_error(code, err, "no sweep.json")
    assert not bad.exists()
