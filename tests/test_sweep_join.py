"""`layerprune analyze sweeps`: sweeps of one model and cut that recovered differently, compared arm by arm on the
items every run scored (pipeline/studies/sweep_join.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import assert_one_line_error, run_cli
from layerprune.core.errors import LayerpruneError

N = 60  # items a task in the first sweep; the second scored the first 40 of the same list


def _eval(folder: Path, scores: dict[str, list[float]], model_hash: str, prompt: str = "p") -> None:
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
                                         "prompt_hash": f"{prompt}{i}", "arguments": [["q", "a"], ["q", "b"]]}) + "\n")
        results.append(TaskResult(task=task, kind=kind, metric=metric, value=float(np.mean(values)), stderr=None,
                                  n=len(values), headline=True, settings={}, seconds=1.0))
    summary = Summary(model={"spec": "x", "location": "x", "kind": "local"}, model_hash=model_hash, results=results)
    (folder / "summary.json").write_text(summary.model_dump_json())


def _sweep(root: Path, name: str, arm: str | None, won: dict[int, list[int]], n: int = N,
           pruned_hash: str = "pruned", prompt: str = "p", chat: bool = False, knows: int = 45,
           original: str = "original") -> Path:
    """A finished sweep at the ks of `won` but 0: the original answers the first 45 copy items, pruning loses them
    all, replicate r of the recovery at k wins back won[k][r] of them (k = 0: the control keeps won[0][r] of the 45);
    `chat`: the same models scored again in eval-chat/, the recovered ones winning back one item fewer."""
    rng = np.random.default_rng(0)
    cls = (rng.random(N) < 0.7).astype(float)[:n].tolist()
    gen = np.r_[np.ones(knows), np.zeros(N - knows)][:n]
    models = {"baseline": (original, gen), **{f"pruned-k{k}": (f"{pruned_hash}{k}", np.zeros(n)) for k in won if k}}
    prefix = arm or "recovered"
    for k, runs in won.items():
        for r, count in enumerate(runs):
            scores = np.zeros(n)
            scores[:count] = 1
            models[f"{prefix}-k{k}" + (f"@r{r}" if r else "")] = (f"{prefix}{k}{r}", scores)
    for label, (model_hash, scores) in models.items():
        _eval(root / "eval" / label, {"piqa": cls, "copy_l7": scores.tolist()}, model_hash, prompt)
        if chat:
            fewer = scores.copy()
            fewer[max(int(scores.sum()) - 1, 0)] = 0 if label.startswith(prefix) else fewer[0]
            _eval(root / "eval-chat" / label, {"copy_l7": fewer.tolist()}, model_hash, "c")
    root.joinpath("sweep.json").write_text(json.dumps({"replicates": len(won[max(won)]),
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
    asked = _sweep(tmp_path / "d", "asked", "sft-other", {0: [45], 1: [20]}, prompt="q")  # other prompts, same items
    with pytest.raises(LayerpruneError, match="no task pairs across the models .*asked different prompts"):
        sweep_join.compare([first, asked])
    for name in ("pruned", "baseline"):
        _sweep(tmp_path / name, name, None, {0: [45], 1: [20]})
        with pytest.raises(LayerpruneError, match=f"{name!r} names the original or the pruned models"):
            sweep_join.compare([first, tmp_path / name])


def test_the_ks_both_pruned_and_the_chat_format_scores_are_compared(tmp_path):
    from layerprune.pipeline.studies import sweep_join

    a = _sweep(tmp_path / "a", "generic", "sft-k-dolly", {0: [45], 1: [10], 2: [5]}, chat=True)  # '-k' in a name
    b = _sweep(tmp_path / "b", "aligned", "sft-gsm8k", {0: [45], 1: [30]}, chat=True)
    data, _ = sweep_join.compare([a, b])
    assert data["ratios"] == [1] and "sft-k-dolly-k2" not in data["models"] and "pruned-k2" not in data["models"]
    chat, text = sweep_join.compare([a, b], "eval-chat")
    share = {p["arm"]: p["generative"]["recovered_share"]["value"] for p in chat["points"]}
    assert share == {"sft-k-dolly": pytest.approx(9 / 45), "sft-gsm8k": pytest.approx(29 / 45)}
    assert chat["items"] == {"copy_l7": N}
    only_plain = _sweep(tmp_path / "c", "plain", "sft-plain", {0: [45], 1: [30]})
    out = tmp_path / "out"
    out.mkdir()
    sweep_join.analyze_sweeps(SimpleNamespace(runs=[a, only_plain]), None, out)
    summary = (out / "summary.md").read_text()  # the plain figures are kept, the chat ones said not compared
    assert "| 1 | sft-plain | generative |" in summary
    assert "Not compared: sweeps: the folders share no pruned k in eval-chat/" in summary


def test_common_items_keep_each_items_chance_in_the_first_models_order():
    from layerprune.evaluate.items import Items, align

    first = Items(("/0", "/1", "/2"), np.array([1.0, 0.0, 1.0]), ("a", "b", "c"), np.array([0.5, 0.25, 0.2]))
    other = Items(("/2", "/0"), np.array([0.0, 1.0]), ("c", "a"), np.array([0.2, 0.5]))
    assert isinstance(align({"x": first, "y": other}), str)  # different sets: refused unless asked
    matrix, chance = align({"x": first, "y": other}, common=True)
    assert matrix.tolist() == [[1.0, 1.0], [1.0, 0.0]] and chance.tolist() == [0.5, 0.2]


def test_the_cli_writes_the_comparison_and_a_refusal_leaves_nothing(tmp_path, capsys):
    a = _sweep(tmp_path / "a", "generic", "sft-dolly", {0: [45], 1: [10]})
    b = _sweep(tmp_path / "b", "aligned", "sft-gsm8k", {0: [45], 1: [30]})
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, ["analyze", "sweeps", "--runs", str(a), str(b), "-o", str(out)])
    assert code == 0, err
    assert (out / "sweeps.json").is_file() and "# Sweeps compared: generic, aligned" in stdout
    bad, not_a_run = tmp_path / "bad", tmp_path / "not-a-run"
    not_a_run.mkdir()
    code, stdout, err = run_cli(capsys, ["analyze", "sweeps", "--runs", str(a), str(not_a_run), "-o", str(bad)])
    assert_one_line_error(code, err, "no sweep.json")
    assert not bad.exists()


def test_runs_of_other_weights_are_compared_each_arm_against_its_own_models_when_asked(tmp_path, capsys):
    from layerprune.pipeline.studies import sweep_join

    a = _sweep(tmp_path / "a", "generic", "sft-dolly", {1: [10, 12, 11]})
    b = _sweep(tmp_path / "b", "aligned", "sft-gsm8k", {1: [15, 15, 15]}, knows=30, original="another realisation",
               pruned_hash="another")
    with pytest.raises(LayerpruneError, match="baseline of .*b is not baseline of .*a .*--own-models"):
        sweep_join.compare([a, b])
    data, text = sweep_join.compare([a, b], own=True)
    share = {p["arm"]: p["generative"]["recovered_share"]["value"] for p in data["points"]}
    assert share == {"sft-dolly": pytest.approx(11 / 45), "sft-gsm8k": pytest.approx(15 / 30)}  # each its own drop
    (pair,) = data["comparisons"]
    assert pair["generative"]["share"]["value"] == pytest.approx(11 / 45 - 0.5)
    assert pair["generative"]["share_status"] == "contradicted" and not pair["generative"]["share_net_of_controls"]
    first = data["own_models"][0]
    assert first["label"] == "baseline" and first["generative"]["value"] == pytest.approx((30 - 45) / N)
    assert any("not the same weights (--own-models)" in line for line in text)
    code, out, err = run_cli(capsys, ["analyze", "sweeps", "--runs", str(a), str(b), "--own-models",
                                      "-o", str(tmp_path / "o")])
    assert code == 0, err
    assert "--own-models --output DIR" in out


def test_one_sweep_is_its_own_figures_again(tmp_path):
    from layerprune.pipeline.studies import sweep_join

    a = _sweep(tmp_path / "a", "generic", "sft-dolly", {0: [45, 40, 44], 1: [10, 12, 11]})
    data, _ = sweep_join.compare([a])
    (point,) = data["points"]
    assert point["generative"]["recovered_share"]["value"] == pytest.approx(11 / 45) and data["comparisons"] == []
    assert data["controls"]["sft-dolly"]["generative"]["change"]["value"] == pytest.approx((43 - 45) / N)
    assert data["verdicts"]["sft-dolly"]["a"]["per_k"]


def test_own_models_compare_arms_net_of_each_arms_own_control(tmp_path):
    from layerprune.pipeline.studies import sweep_join

    a = _sweep(tmp_path / "a", "generic", "sft-dolly", {0: [40], 1: [10]})  # its control loses 5 of the 45
    b = _sweep(tmp_path / "b", "aligned", "sft-gsm8k", {0: [30], 1: [15]}, knows=30, original="other",
               pruned_hash="other")
    data, text = sweep_join.compare([a, b], own=True)
    assert any("sft-dolly - sft-gsm8k at k = 1, generative: recovered share net of each arm's control" in line
               for line in text)
    net = {p["arm"]: p["generative"]["recovered_share_net"]["value"] for p in data["points"]}
    assert net == {"sft-dolly": pytest.approx((10 + 5) / 45), "sft-gsm8k": pytest.approx(15 / 30)}
    (pair,) = data["comparisons"]
    assert pair["generative"]["share_net_of_controls"]
    assert pair["generative"]["share"]["value"] == pytest.approx(15 / 45 - 15 / 30)
    c = _sweep(tmp_path / "c", "plain", "sft-plain", {1: [15]}, knows=30, original="third", pruned_hash="third")
    (mixed,) = sweep_join.compare([a, c], own=True)[0]["comparisons"]  # one arm without a control: gross shares
    assert not mixed["generative"]["share_net_of_controls"]
    assert mixed["generative"]["share"]["value"] == pytest.approx(10 / 45 - 15 / 30)


def test_an_arm_ending_at_a_budget_of_its_own_is_left_out_of_the_pairs_as_its_sweep_md_leaves_it(tmp_path):
    """A budget study's positive control trains to 32k (arm_budgets) while its sweep's other arms train to 256k: the
    join, like that sweep's own sweep.md, leaves it out of the arms compared and says so (before: paired with every
    other arm, 32k against 256k, in the Holm family, with no word)."""
    from layerprune.pipeline.studies import sweep_join

    generic = _sweep(tmp_path / "a", "generic", "sft-dolly", {0: [45, 44, 45], 1: [10, 12, 11]})
    control = _sweep(tmp_path / "b", "budget", "kd-arith", {0: [45, 45, 44], 1: [30, 33, 36]})
    control.joinpath("run.json").write_text(json.dumps({"recipe": {
        "name": "budget", "budgets": [8000, 32000, 256000], "arm_budgets": {"kd-arith": [8000, 32000]}}}))
    data, text = sweep_join.compare([generic, control])
    assert data["comparisons"] == [] and {p["arm"] for p in data["points"]} == {"sft-dolly", "kd-arith"}
    assert ("Rows at a budget of their own (arm_budgets), left out of the arms compared: kd-arith at 32,000 target "
            "tokens, its sweep's other arms at 256,000.") in text
    own, _ = sweep_join.compare([generic, control], own=True)
    assert own["comparisons"] == []
    control.joinpath("run.json").write_text(json.dumps({"recipe": {"name": "budget", "budgets": [8000, 32000]}}))
    assert len(sweep_join.compare([generic, control])[0]["comparisons"]) == 1  # ending with the others: compared
