"""Paper B's probes with power: shallow bracket depths evaluated whole with a calibration stream of their own, 500
arithmetic items, a gate that gives every candidate its score, interval and reason, and probes in chat format."""

from __future__ import annotations

import itertools
import json

import pytest

from helpers import assert_one_line_error
from layerprune.core.errors import LayerpruneError
from layerprune.evaluate import calibrated
from layerprune.evaluate.calibrated import ProbeCalibration, calibrate_probes, wilson
from layerprune.evaluate.project_tasks import chat_prompt, probe_config, probe_messages, probe_rows
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import plan_tasks
from layerprune.evaluate.task_specs import TASKS
from layerprune.tasks.probes import BRACKETS, PROBE_DOCS, evaluation_questions, generate_probes, probe_tasks
from tiny import tiny_tokenizer

SHALLOW = {2: 9, 3: 27, 4: 81, 5: 243}  # 3 bracket pairs, one chosen per level of nesting: 3**depth sequences


def bracket_question(opening: tuple[str, ...]) -> str:
    return f"Input: {' '.join(opening)}\nClosing:"


@pytest.mark.parametrize("seed", [0, 41])  # seed 41: 1000 repeated draws in a row once missed a depth-5 sequence
def test_shallow_bracket_depths_are_evaluated_whole(seed):
    for depth, count in SHALLOW.items():
        items = generate_probes(probe_tasks()[f"brackets_d{depth}"], PROBE_DOCS, seed)
        every = {bracket_question(o) for o in itertools.product(BRACKETS, repeat=depth)}
        assert len(every) == count and len(items) == count, depth
        assert {p.question for p in items} == every, depth


def test_every_level_has_a_calibration_stream_disjoint_from_every_scored_item():
    scored = frozenset().union(*(evaluation_questions(f) for f in {str(a["family"]) for a in probe_tasks().values()}))
    for task, args in probe_tasks().items():
        calib = generate_probes(args, PROBE_DOCS, 0, stream="calib")
        assert calib, f"{task} has no calibration stream"
        asked = {p.question for p in calib} | {q for p in calib for q, _ in p.examples}
        assert not asked & scored, task
        assert len({p.question for p in calib}) == len(calib), task
    for depth, count in ((2, 7), (3, 37), (4, 175)):  # 4**d - 3**d sequences over four pairs with a '<'
        calib = generate_probes(probe_tasks()[f"brackets_d{depth}"], PROBE_DOCS, 0, stream="calib")
        assert len(calib) == count and all("<" in p.question for p in calib)
    mix = generate_probes(probe_tasks()["brackets_mix"], PROBE_DOCS, 0)
    assert len({p.question for p in mix}) == PROBE_DOCS
    mix_calib = generate_probes(probe_tasks()["brackets_mix"], PROBE_DOCS, 0, stream="calib")
    depths = {len(p.question.splitlines()[0].split()) - 1 for p in mix_calib}
    assert depths == {2, 3, 4, 5, 6}  # every depth the evaluation asks, not only those it leaves questions of


def test_arithmetic_levels_give_500_distinct_items_and_the_sweep_scores_them_all():
    arithmetic = [t for t, a in probe_tasks().items() if a["family"] == "arithmetic"]
    for task in arithmetic:
        questions = [row["prompt"].splitlines()[-1] for row in probe_config(TASKS.get(task), 0)["custom_dataset"]()
                     ["test"]]
        assert len(set(questions)) == PROBE_DOCS, task
    levels = ["arith_1dc", "arith_2d_add", "arith_2d_sub", "brackets_d2", "brackets_d3", "brackets_d4"]
    planned, _ = plan_tasks(EvalSettings(suite="sweep-cpu", only=levels), None)
    limits = {t.spec.name: t.limit for t in planned}
    assert limits == {**dict.fromkeys(levels[:3], 500), **dict.fromkeys(levels[3:], 300)}
    assert set(ProbeCalibration().candidates) >= set(levels)


def fake_scorer(rates: dict[str, float]):
    def score(task: str, items: list) -> list[bool]:
        right = round(rates[task] * len(items))
        return [i < right for i in range(len(items))]
    return score


def test_the_gate_reports_every_candidate_with_its_interval_and_reason(monkeypatch):
    rates = {"arith_2d_add": 0.25, "arith_1d_sum3": 0.5, "arith_1dc": 0.85, "copy_l3": 0.97, "brackets_d2": 0.6,
             "brackets_d3": 0.4, "brackets_d4": 0.3, "reverse_l3": 0.5}
    real = calibrated.calibration_items
    monkeypatch.setattr(calibrated, "calibration_items",
                        lambda task, n, trained: ([], 0) if task == "reverse_l3" else real(task, n, trained))
    settings = ProbeCalibration(candidates=list(rates), items=100)
    lines: list[str] = []
    record = calibrate_probes(None, None, settings, lines.append, scorer=fake_scorer(rates))
    levels = record["levels"]
    assert set(levels) == set(rates) and record["kept"] == ["arith_1d_sum3", "brackets_d3"]
    reasons = {t: r["reason"] for t, r in levels.items()}
    assert reasons == {"arith_2d_add": "below band", "arith_1d_sum3": "in band", "arith_1dc": "in band, not kept",
                       "copy_l3": "above band", "brackets_d2": "too few distinct items", "brackets_d3": "in band",
                       "brackets_d4": "in band, not kept", "reverse_l3": "no calibration stream"}
    low, high = levels["arith_2d_add"]["interval"]
    assert (low, high) == pytest.approx(wilson(25, 100)) and low < 0.25 < high
    assert (low, high) == pytest.approx((0.1755, 0.3431), abs=1e-3)
    assert levels["brackets_d2"]["items"] == 7 and levels["brackets_d2"]["eval_items"] == 9
    assert levels["brackets_d3"]["items"] == 37 and levels["brackets_d3"]["eval_items"] == 27
    assert all(r["band"] == [0.3, 0.9] for r in levels.values())
    assert "25% (95% CI 18-34%, 100 items) is below the band 30-90%" in levels["arith_2d_add"]["why"]
    for task in rates:  # one printed line per candidate, its decision in words
        assert sum(line.startswith(f"{task}: kept") or line.startswith(f"{task}: left out") for line in lines) == 1
    json.dumps(record)  # the sweep writes it as JSON


def test_the_gate_passes_over_what_a_variant_was_trained_on(tiny_llama, tmp_path):
    """A post-trained variant draws its data from the calibration stream the gate reads: the gate leaves those
    questions out (the variant's report keeps its recipe), so it measures the skill, not what was memorized."""
    import shutil

    from layerprune.core.settings import RunSettings
    from layerprune.models.lineage import VARIANT_REPORT
    from layerprune.pipeline.studies.cells import CALIBRATION_FILE, calibrate
    from layerprune.posttrain.api import trained_questions
    from layerprune.posttrain.schema import VariantRecipe

    recipe = VariantRecipe(data={"probes": {"arith_2d_sub": 150, "brackets_mix": 40}, "seed": 0})
    variant = tmp_path / "variant"
    shutil.copytree(tiny_llama, variant)
    (variant / VARIANT_REPORT).write_text(json.dumps({"recipe": recipe.model_dump(mode="json")}))
    trained = trained_questions(variant)
    assert len(trained) == 190 and trained_questions(tiny_llama) == frozenset()  # any other model: nothing
    gsm8k = tmp_path / "gsm8k-variant"  # GSM8K rows are not probe questions: nothing reads the GSM8K mirror
    gsm8k.mkdir()
    (gsm8k / VARIANT_REPORT).write_text(json.dumps({"recipe": VariantRecipe(
        data={"probes": {"arith_2d_sub": 5}, "gsm8k": 100}).model_dump(mode="json")}))
    assert len(trained_questions(gsm8k)) == 5
    (gsm8k / VARIANT_REPORT).write_text(json.dumps({"recipe": {"kind": "sft", "trian": {}}}))
    with pytest.raises(LayerpruneError, match="its recipe does not read"):
        trained_questions(gsm8k)
    stream = generate_probes(probe_tasks()["arith_2d_sub"], 30, 0, stream="calib")
    assert sum(p.question in trained for p in stream) > 20  # the first gate items are the variant's training items

    settings = ProbeCalibration(candidates=["arith_2d_sub", "brackets_mix"], items=30)
    calibrate(str(variant), settings, RunSettings(device="cpu"), tmp_path)
    record = json.loads((tmp_path / CALIBRATION_FILE).read_text())
    assert record["trained_questions"] == 190
    for task in settings.candidates:
        level = record["levels"][task]
        assert level["items"] == 30 and level["trained_passed_over"] > 0, task
    seen: dict[str, list] = {}
    calibrate_probes(None, None, settings, scorer=lambda task, items: seen.setdefault(task, items) and [],
                     trained=trained)
    for task, items in seen.items():
        assert len(items) == 30 and not {p.question for p in items} & trained, task
        first = [p for p in generate_probes(probe_tasks()[task], 400, 0, stream="calib") if p.question not in trained]
        assert [p.question for p in items] == [p.question for p in first[:30]]  # the stream's first untrained items


def test_chat_format_renders_the_examples_as_turns_of_the_chat_template():
    tokenizer, spec = tiny_tokenizer(), TASKS.get("brackets_d3")
    probe = probe_rows(spec, 0)[0]
    assert [m["role"] for m in probe_messages(probe)] == ["user", "assistant"] * 3 + ["user"]
    text = chat_prompt(probe, tokenizer)
    assert text == tokenizer.apply_chat_template(probe_messages(probe), tokenize=False, add_generation_prompt=True)
    assert text.count("<|user|>") == 4 and text.endswith("<|assistant|>") and probe.examples[0][1].strip() in text
    from lm_eval.tasks import TaskManager

    config = probe_config(spec, 0, probe_format="chat")
    task = TaskManager(include_defaults=False).load([config])["tasks"][spec.name]

    def render(messages: list, add_generation_prompt: bool = True) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    doc = task.test_docs()[0]
    assert task.fewshot_context(doc, 3, apply_chat_template=True, fewshot_as_multiturn=True,
                                chat_template=render) == text  # lm-eval's own multiturn rendering
    plain = probe_config(spec, 0)
    assert plain["doc_to_text"] == "{{prompt}}" and plain["num_fewshot"] == 0 and "fewshot_config" not in plain
    planned, _ = plan_tasks(EvalSettings(tasks=["brackets_d3"], probe_format="chat"), None)
    assert planned[0].num_fewshot == 3
    tokenizer.chat_template = None
    with pytest.raises(LayerpruneError, match="chat template"):
        chat_prompt(probe, tokenizer)


def test_chat_probes_through_lm_eval_on_a_tiny_model(capsys, tmp_path, tiny_llama):
    from helpers import run_cli
    from layerprune.evaluate.summary import Summary

    args = ["evaluate", "--model", str(tiny_llama), "--tasks", "brackets_d2", "--limit", "2", "--probe-format", "chat",
            "--output", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c")]
    code, _, err = run_cli(capsys, args)
    assert code == 0, err
    result = Summary.model_validate_json((tmp_path / "o" / "summary.json").read_text()).results[0]
    assert result.settings["chat_template"] is True and result.settings["num_fewshot"] == 3
    assert result.settings["probe_format"] == "chat"
    sample = json.loads((tmp_path / "o" / "samples" / "brackets_d2.jsonl").read_text().splitlines()[0])
    assert "<|assistant|>" in json.dumps(sample)


def test_chat_format_is_refused_for_a_model_without_a_template(capsys, tmp_path, tiny_llama):
    import shutil

    from helpers import run_cli

    plain = tmp_path / "plain"
    shutil.copytree(tiny_llama, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    code, _, err = run_cli(capsys, ["evaluate", "--model", str(plain), "--tasks", "brackets_d2", "--limit", "2",
                                    "--probe-format", "chat", "--cache-dir", str(tmp_path / "c")])
    assert_one_line_error(code, err, "this model has none")
