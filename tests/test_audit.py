"""Held out, measured: the recovery data against each scored task's items (pipeline/audit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerprune.analyze import metrics
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import shipped_recipes
from layerprune.pipeline import audit
from layerprune.pipeline.studies.recovery import RecoveryStudy
from layerprune.tasks.data import read_jsonl
from layerprune.tasks.probes import EVAL_SEED, generate_probes, probe_tasks

PLAIN = [{"prompt": "Tell me about the history of the bicycle and who invented the first one.",
          "response": "The first bicycle, the draisine, was built by Karl Drais in 1817 in Mannheim."},
         {"prompt": "Why is the sky blue?", "response": "Sunlight scatters off air molecules; blue light the most."}]


def probe_items(task: str, n: int, stream: str = "eval") -> list:
    return generate_probes(probe_tasks()[task], n, EVAL_SEED, stream)  # type: ignore[arg-type]


def write_eval_samples(root: Path, task: str, docs: list[dict]) -> None:
    """lm-eval's samples file as `evaluate` writes it: one line per document and filter."""
    folder = root / "eval" / "baseline" / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"doc_id": i, "doc": doc, "filter": f, "target": doc.get("answer"), "exact_match": 0.0})
             for i, doc in enumerate(docs) for f in ("strict-match", "flexible-extract")]
    (folder / f"{task}.jsonl").write_text("\n".join(lines) + "\n")


def test_audit_flags_exactly_the_tasks_whose_items_the_recovery_data_holds(tmp_path):
    """3 of 20 copy_l7 items rendered as recovery prompts (as evaluate renders them), 2 arithmetic items asked and
    answered by the teacher, and a GSM8K question whose answer the teacher gives (its 8-grams only across prompt +
    answer): those three tasks flagged with those counts; reverse_l7, whose items are nowhere, held out."""
    copy, arith, reverse = probe_items("copy_l7", 20), probe_items("arith_2d_add", 20), probe_items("reverse_l7", 20)
    records = [*PLAIN, *({"prompt": p.prompt, "response": "Sure."} for p in copy[4:7]),
               *({"prompt": p.prompt, "response": p.answer} for p in arith[:2]),
               {"prompt": "Solve: A farmer has 12 cows and buys", "response": "5 more; how many cows"}]
    (tmp_path / "selfgen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for task, items in (("copy_l7", copy), ("arith_2d_add", arith), ("reverse_l7", reverse)):
        write_eval_samples(tmp_path, task, [{"prompt": p.prompt, "answer": p.answer} for p in items])
    write_eval_samples(tmp_path, "gsm8k", [{"question": "A farmer has 12 cows and buys 5 more; how many cows now?",
                                            "answer": "He has 12 + 5 = 17 cows.\n#### 17"}])
    found = audit.audit_study(tmp_path, ["copy_l7", "arith_2d_add", "reverse_l7", "gsm8k", "piqa"])
    tasks = found["tasks"]
    assert {t for t, row in tasks.items() if row["flagged"]} == {"copy_l7", "arith_2d_add", "gsm8k"}
    assert (tasks["copy_l7"]["items"], tasks["copy_l7"]["prompts"], tasks["copy_l7"]["either"]) == (20, 3, 3)
    assert tasks["copy_l7"]["verdict"] == "FLAG: copy_l7 items appear in the recovery prompts/answers (3 of 20)"
    assert tasks["copy_l7"]["max_prompts"] == 1.0
    assert (tasks["arith_2d_add"]["prompts"], tasks["arith_2d_add"]["either"]) == (2, 2)
    assert (tasks["gsm8k"]["items"], tasks["gsm8k"]["prompts"], tasks["gsm8k"]["answers"], tasks["gsm8k"]["either"]) \
        == (1, 0, 0, 1)  # one document (logged once per filter), in neither half: across the two
    assert tasks["reverse_l7"]["verdict"] == "held out (measured)"
    assert tasks["piqa"]["verdict"] == "not measured (no samples/piqa.jsonl)"
    assert json.loads((tmp_path / "audit.json").read_text())["tasks"]["copy_l7"]["either"] == 3
    text = "\n".join(audit.audit_lines(found))
    assert "| copy_l7 | 20 | 3 | 0 | 3 | 100% / 0% | FLAG: copy_l7 items appear" in text
    assert "| reverse_l7 | 20 | 0 | 0 | 0 | 0% / 0% | held out (measured) |" in text
    assert "| piqa | 0 | - | - | - | - | not measured (no samples/piqa.jsonl) |" in text


def test_recovery_data_from_the_calibration_stream_is_held_out():
    """Probe prompts from the calibration stream (the recovery's own) with their answers: no eval item among them."""
    tasks = ["copy_l3", "count_2to5", "arith_2d_add", "arith_1d_sum3", "brackets_d7"]
    records = [{"prompt": p.prompt, "response": p.answer} for t in tasks for p in probe_items(t, 60, "calib")]
    items = {t: [p.question for p in probe_items(t, 60)] for t in tasks}
    found = audit.audit_recovery_data([*PLAIN, *records], items)
    assert all(row["either"] == 0 and row["verdict"] == "held out (measured)" for row in found["tasks"].values())
    found = audit.audit_recovery_data(records[:3] + [{"prompt": "Q", "response": items["count_2to5"][7]}], items)
    assert found["tasks"]["count_2to5"]["answers"] == 1  # a 6-token question, whole in an answer
    assert found["tasks"]["brackets_d7"]["max_prompts"] == 0  # 8 of its 11 tokens open many calibration questions


def test_a_small_share_of_overlapping_items_is_reported_but_not_flagged():
    """One item of 200 (under 1%) shares a 4-gram with a prompt: counted, not flagged; two of 200 are flagged."""
    records = [{"prompt": "Question number 5 asks", "response": "Saturn."}]
    row = audit.audit_recovery_data(records, {"t": ["Question number 5 asks which"] + ["unrelated words here"] * 199},
                                    n=4)["tasks"]["t"]
    assert (row["either"], row["flagged"]) == (1, False)
    assert row["verdict"] == "held out (measured: 1 of 200 items overlap, under 1%)"
    records.append({"prompt": "", "response": "unrelated words here"})
    row = audit.audit_recovery_data(records, {"t": ["Question number 5 asks which", "unrelated words here"]
                                              + ["other words"] * 198}, n=4)["tasks"]["t"]
    assert (row["either"], row["flagged"]) == (2, True)


def test_copy_share_counts_answers_that_re_emit_a_run_of_their_prompt():
    listing = {"prompt": "Extract the fruits: apple, banana, cherry, date and elderberry grow here.",
               "response": "apple, banana, cherry, date and elderberry"}  # 9 tokens of the prompt, in order
    answer = {"prompt": "What is the capital of France?", "response": "Paris is the capital of France."}
    assert audit.longest_copied_span(metrics.words(listing["prompt"]), metrics.words(listing["response"])) == 9
    assert audit.longest_copied_span(metrics.words(answer["prompt"]), metrics.words(answer["response"])) == 5
    assert audit.longest_copied_span(["a", "b", "a", "b", "c"], ["x", "a", "b", "c", "a"]) == 3
    stats = audit.copy_stats([listing, answer])
    assert (stats["copying"], stats["share"], stats["mean_longest_span"]) == (1, 0.5, 7.0)
    assert audit.copy_stats([listing, answer], n=10)["copying"] == 0


def test_repetition_is_the_analyze_rep_n():
    records = [{"prompt": "Say it.", "response": "go on go on go on"}, {"prompt": "Why?", "response": "Because."}]
    stats = audit.copy_stats(records)
    assert stats["rep_2"] == pytest.approx((1 - 2 / 5 + 0) / 2)  # go on go on go on: 2 distinct bigrams of 5
    for n in (2, 3, 4):
        assert stats[f"rep_{n}"] == metrics.mean_or_none([metrics.rep_n(metrics.words(r["response"]), n)
                                                          for r in records])


def test_list_probes_carry_a_near_transfer_note_when_the_answers_copy_their_prompts():
    copying = [{"prompt": f"List these: {' '.join(f'item{i}{j}' for j in range(10))}.",
                "response": " ".join(f"item{i}{j}" for j in range(10))} for i in range(3)]
    items = {"copy_l3": [p.question for p in probe_items("copy_l3", 10)],
             "arith_2d_add": [p.question for p in probe_items("arith_2d_add", 10)]}
    found = audit.audit_recovery_data(copying + PLAIN * 10, items)
    assert found["copy"]["share"] == pytest.approx(3 / 23)
    assert "near transfer: 13% of the teacher's answers copy" in found["tasks"]["copy_l3"]["verdict"]
    assert found["tasks"]["arith_2d_add"]["verdict"] == "held out (measured)"
    assert any("the list probes (copy, reverse, count) are near transfer" in line for line in audit.audit_lines(found))
    plain = audit.audit_recovery_data(PLAIN, items)
    assert plain["tasks"]["copy_l3"]["verdict"] == "held out (measured)"


def test_audit_refuses_a_study_without_teacher_answers_and_its_report_section_is_empty(tmp_path):
    with pytest.raises(LayerpruneError, match="no teacher answers to audit"):
        audit.audit_study(tmp_path, ["copy_l7"])
    assert not (tmp_path / "audit.json").exists()
    assert audit.audit_section(tmp_path) == []  # the report's section: none, rather than an error
    (tmp_path / "selfgen.jsonl").write_text(json.dumps(PLAIN[0]) + "\n")
    docs = [{"prompt": p.prompt, "answer": p.answer} for p in probe_items("copy_l7", 5)]
    write_eval_samples(tmp_path, "copy_l7", docs)
    section = audit.audit_section(tmp_path)
    assert section[:2] == ["", "## Held out, measured"]
    assert "| copy_l7 | 5 | 0 | 0 | 0 | 0% / 0% | held out (measured) |" in "\n".join(section)
    assert json.loads((tmp_path / "audit.json").read_text())["source"] == str(tmp_path / "selfgen.jsonl")
    (tmp_path / "selfgen.jsonl").unlink()  # a run unpacked from its records: the answers left out, audit.json kept
    assert audit.audit_section(tmp_path) == section


def test_transfer_study_trains_on_dolly_prompts_that_hold_none_of_its_scored_items(shared_data):
    """The transfer study's claim 'every scored skill held out', measured on its 400 Dolly prompts against the items
    it scores (arc_easy, piqa 200 each, copy_l7 300), at one token budget (replaces a check by the source's name)."""
    from layerprune.recover.prompts import load_prompts

    path = next(p for p in shipped_recipes("recovery-study").values() if p.stem == "recovery-transfer-embedded")
    study = RecoveryStudy.load(path)
    shared = study.shared_recipe("<pruned>")
    assert shared.train.max_tokens >= 50_000 and shared.generate.temperature == 0
    assert study.prune.n_drop == 3 and study.prune.score == "ablation" and study.prune.metric == "nll"
    chains = {label: study.arm_recipe(label, "<pruned>").chain_name() for label in study.arms}
    assert chains == {"sft": "lora", "kd": "kd", "merge": "merge", "local": "local", "merge+local": "merge+local",
                      "replace+local": "replace+local"}
    prompts, _ = load_prompts(shared.prompts, shared_data)
    records = [{"prompt": p.text, "response": ""} for p in prompts]
    samples = {"arc_easy": read_jsonl(shared_data / "arc_easy" / "test.jsonl")[:200],
               "piqa": read_jsonl(shared_data / "piqa" / "validation.jsonl")[:200]}
    items = {task: [audit.item_text(task, {"doc": row}) or "" for row in rows] for task, rows in samples.items()}
    copy = probe_items("copy_l7", 300)
    items["copy_l7"] = [audit.item_text("copy_l7", {"doc": {"prompt": p.prompt, "answer": p.answer}}) or ""
                        for p in copy]
    assert items["copy_l7"][0] == copy[0].question  # the few-shot prefix left out
    found = audit.audit_recovery_data(records, items)
    assert len(records) == 400 and {t: row["either"] for t, row in found["tasks"].items()} == {
        "arc_easy": 0, "piqa": 0, "copy_l7": 0}
