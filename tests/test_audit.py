"""Held out, measured: the recovery data against each scored task's items (pipeline/audit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerprune.analyze import metrics
from layerprune.core.errors import LayerpruneError
from layerprune.pipeline import audit, audit_report
from layerprune.pipeline.studies.sweep_grid import SweepStudy
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
    assert tasks["reverse_l7"]["either"] == 0 and not tasks["reverse_l7"]["flagged"]
    assert tasks["reverse_l7"]["template_records"] == 3  # the copy prompts' 7-letter lists: its kind of question
    assert tasks["reverse_l7"]["verdict"].startswith("held out (measured); near transfer: 3 recovery record(s)")
    assert tasks["piqa"]["verdict"] == "not measured (no samples/piqa.jsonl)"
    import hashlib  # the audited data's digest: the data is not archived, a re-audit must show it is the same data

    assert found["source_sha256"] == hashlib.sha256((tmp_path / "selfgen.jsonl").read_bytes()).hexdigest()
    assert json.loads((tmp_path / "audit.json").read_text())["tasks"]["copy_l7"]["either"] == 3
    text = "\n".join(audit_report.audit_lines(found))
    assert "| copy_l7 | 20 | 3 | 0 | 3 | 100% / 0% | 0 (0.0) | 3 | 0 | FLAG: copy_l7 items appear" in text
    assert "| reverse_l7 | 20 | 0 | 0 | 0 | 0% / 0% | 0 (0.0) | 3 | 0 | held out (measured); near transfer" in text
    assert "| gsm8k | 1 | 0 | 0 | 1 | 0% / 0% | - | - | 0 | FLAG" in text
    assert "| piqa | 0 | - | - | - | - | - | - | 0 | not measured (no samples/piqa.jsonl) |" in text


def test_recovery_data_from_the_calibration_stream_is_held_out():
    """Probe prompts from the calibration stream (the recovery's own) with their answers: no eval item among them."""
    tasks = ["copy_l3", "count_2to5", "arith_2d_add", "arith_1d_sum3", "brackets_d7"]
    records = [{"prompt": p.prompt, "response": p.answer} for t in tasks for p in probe_items(t, 60, "calib")]
    items = {t: [p.question for p in probe_items(t, 60)] for t in tasks}
    found = audit.audit_recovery_data([*PLAIN, *records], items)
    for task, row in found["tasks"].items():
        assert row["either"] == 0 and not row["flagged"], task
        assert row["template_records"] >= 60 and row["verdict"].startswith("held out (measured); near transfer"), task
        assert row["near"] <= 2 * row["near_expected"] + 5, task  # neighbours in a small family: chance, not copies
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
    lines = audit_report.audit_lines(found)
    assert any("the list probes (copy, reverse, count) are near transfer" in line for line in lines)
    plain = audit.audit_recovery_data(PLAIN, items)
    assert plain["tasks"]["copy_l3"]["verdict"] == "held out (measured)"


def test_audit_refuses_a_study_without_teacher_answers_and_its_report_section_is_empty(tmp_path):
    with pytest.raises(LayerpruneError, match="no teacher answers to audit"):
        audit.audit_study(tmp_path, ["copy_l7"])
    assert not (tmp_path / "audit.json").exists()
    assert audit_report.audit_section(tmp_path) == []  # the report's section: none, rather than an error
    (tmp_path / "selfgen.jsonl").write_text(json.dumps(PLAIN[0]) + "\n")
    docs = [{"prompt": p.prompt, "answer": p.answer} for p in probe_items("copy_l7", 5)]
    write_eval_samples(tmp_path, "copy_l7", docs)
    section = audit_report.audit_section(tmp_path)
    assert section[:2] == ["", "## Held out, measured"]
    assert "| copy_l7 | 5 | 0 | 0 | 0 | 0% / 0% | 0 (0.0) | 0 | 0 | held out (measured) |" in "\n".join(section)
    assert json.loads((tmp_path / "audit.json").read_text())["source"] == str(tmp_path / "selfgen.jsonl")
    (tmp_path / "selfgen.jsonl").unlink()  # a run unpacked from its records: the answers left out, audit.json kept
    assert audit_report.audit_section(tmp_path) == section


def test_transfer_study_trains_on_dolly_prompts_that_hold_none_of_its_scored_items(shared_data):
    """The transfer study's claim 'every scored skill held out', measured on its 400 Dolly prompts against the items
    it scores (arc_easy, piqa 200 each, copy_l7 300), at one token budget (replaces a check by the source's name)."""
    from layerprune.recover.prompts import load_prompts

    study = SweepStudy.load("recovery-transfer-embedded")  # a sweep of one k (issue 56)
    shared = study.shared_recipe("<pruned>")
    assert shared.train.max_tokens >= 50_000 and shared.generate.temperature == 0
    assert study.ratios == [3] and study.prune.score == "ablation" and study.prune.metric == "nll"
    assert [*study.classification, *study.fixed] == ["arc_easy", "piqa", "copy_l7"] and study.probes is None
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


# Contamination that is not verbatim (issue 57, part 3): each kind planted in 3 of 150 items among clean records.

def _plant(task: str, render, count: int = 3, n: int = 150) -> dict:
    """The audit of `count` of `task`'s first `n` items rendered by `render` into recovery prompts among PLAIN."""
    items = probe_items(task, n)
    records = [*PLAIN, *({"prompt": render(p.question), "response": "Done."} for p in items[10:10 + count])]
    return audit.audit_recovery_data(records, {task: [p.question for p in items]})["tasks"][task]


def _one_changed(question: str, at: int) -> str:
    """A copy question with its `at`-th letter changed (k -> l, z -> a)."""
    head, tail = question.split("\n")
    letters = head.removeprefix("Input: ").split()
    letters[at] = "abcdefghijklmnopqrstuvwxyza"["abcdefghijklmnopqrstuvwxyz".index(letters[at]) + 1]
    return f"Input: {' '.join(letters)}\n{tail}"


def test_a_copy_item_with_one_letter_changed_is_a_near_duplicate_and_flagged():
    row = _plant("copy_l7", lambda q: _one_changed(q, 3))
    assert (row["either"], row["near"], row["flagged"]) == (0, 3, True)  # old code: 0 overlapping, held out
    assert row["near_expected"] < 0.01 and row["near_p"] < audit.NEAR_P
    assert row["verdict"].startswith("FLAG: 3 of 150 copy_l7 items are one value from a recovery question")


def test_an_arithmetic_item_with_one_number_changed_is_flagged_where_chance_cannot_explain_it():
    """5-digit sums: a question one number from an item is almost never one by chance: flagged. 2-digit differences:
    most questions are one number from some item, so the three are reported (near, with the number chance gives)
    and the task is near transfer (its template asked), not flagged."""
    def bump_second(question: str) -> str:
        a, op, b, eq = question.split()
        return f"{a} {op} {int(b) + 1} {eq}"

    row = _plant("arith_5d_add", bump_second)
    assert (row["either"], row["near"], row["template_records"], row["flagged"]) == (0, 3, 3, True)
    row = _plant("arith_2d_sub", bump_second, n=100)
    assert (row["either"], row["template_records"], row["flagged"]) == (0, 3, False)
    assert row["near"] >= 3 and row["near_expected"] > 1  # old code: no near count, 'held out (measured)'
    assert row["verdict"].startswith("held out (measured); near transfer: 3 recovery record(s) ask this task's kind")


def test_a_reformatted_arithmetic_item_is_the_item():
    """'What is 81 - 50?' for '81 - 50 =', and '81 minus 50 equals 31' after a 'Compute': the item, in other words."""
    def asked(question: str) -> str:
        return f"What is {question.removesuffix(' =')}?"

    row = _plant("arith_2d_sub", asked, n=100)
    assert (row["prompts"], row["either"], row["flagged"]) == (3, 3, True)
    worded = _plant("arith_2d_sub", lambda q: "Compute " + q.replace("-", "minus").removesuffix(" ="), n=100)
    assert worded["either"] == 3


def test_a_sum_with_its_addends_swapped_is_the_item():
    """'50 + 31 =' for the item '31 + 50 =': a sum holds its addends in any order (the kd-arith prompts of the budget
    study held 16 of 150 scored arith_2d_add items so). Old code: 0 overlapping."""
    def swapped(question: str) -> str:
        a, _, b, eq = question.split()
        return f"{b} + {a} {eq}"

    row = _plant("arith_2d_add", swapped, n=100)
    assert (row["prompts"], row["either"], row["flagged"]) == (3, 3, True)


def test_a_comma_separated_copy_list_and_another_cue_word_are_the_item():
    def commas(question: str) -> str:
        return "Repeat this list back to me: " + ", ".join(question.split("\n")[0].removeprefix("Input: ").split())

    row = _plant("copy_l7", commas)
    assert (row["prompts"], row["flagged"]) == (3, True)
    row = _plant("copy_l7", lambda q: q.replace("Copy:", "Repeat:").upper())
    assert (row["prompts"], row["flagged"]) == (3, True)
    row = _plant("brackets_d7", lambda q: "Close these brackets: " + q.split("\n")[0].removeprefix("Input: ")
                 .replace(" ", ""))
    assert (row["prompts"], row["flagged"]) == (3, True)


def test_a_reformatted_document_is_found_on_normalized_text():
    """A document's question with its case, punctuation and spacing changed: the same normalized 8-grams (old code
    kept punctuation marks as tokens, so the dashes and semicolon broke every 8-gram)."""
    question = "Which of these would help to prevent infections from being spread?"
    for variant in ("WHICH  OF  THESE  WOULD  HELP  TO  PREVENT  INFECTIONS  FROM  BEING  SPREAD !!",
                    "Which of these -- would help, to prevent: infections; from being spread"):
        records = [*PLAIN, {"prompt": variant, "response": "Wash."}]
        row = audit.audit_recovery_data(records, {"arc_easy": [question]})["tasks"]["arc_easy"]
        assert (row["prompts"], row["flagged"]) == (1, True), variant


def test_ordinary_prose_with_numbers_lists_and_brackets_is_not_a_probe_template():
    prose = [{"prompt": "Summarize: in 1817 - 1820 Drais built 2 bikes; pages 12 - 15 (see [1]) tell how.",
              "response": "The U.S.A. and e.g. the U.K. had 3 or 4 makers by 1900, per the a, b list."},
             {"prompt": "Is 5 more than 3?", "response": "Yes, 5 is 2 more than 3, (i.e. ((roughly)) so)."},
             {"prompt": ">>> intersperse([], 4)\n[]\n>>> longest(['a', 'bb'])", "response": 'Send [{"id": 1}] as '
              "JSON, or f([x, y])."}]  # code and JSON: before, '([' and '[{' were bracket sequences (brackets_d2's)
    tasks = ["arith_4d_sub", "arith_2d_sub", "arith_1dc", "copy_l3", "brackets_d2", "count_2to5"]
    found = audit.audit_recovery_data(prose, {t: [p.question for p in probe_items(t, 50)] for t in tasks})
    assert {t: (row["either"], row["template_records"], row["flagged"]) for t, row in found["tasks"].items()} == {
        t: (0, 0, False) for t in tasks}


def test_generic_instructions_flag_nothing(shared_data):
    """400 Dolly instructions and their human answers against every probe family's items and two documents' tasks:
    no task flagged (the digits placeholder and the letter lists do not turn prose into probe items)."""
    rows = read_jsonl(shared_data / "dolly" / "train.jsonl")[:400]
    records = [{"prompt": r["instruction"], "response": r["response"]} for r in rows]
    tasks = ["arith_2d_add", "arith_2d_sub", "arith_3d_mul", "arith_1dc", "arith_1d_sum3", "copy_l3", "copy_l7",
             "reverse_l5", "count_2to5", "brackets_d3", "brackets_d6", "brackets_mix"]
    items = {t: [p.question for p in probe_items(t, 150)] for t in tasks}
    for task, split in (("arc_easy", "test"), ("piqa", "validation")):
        docs = read_jsonl(shared_data / task / f"{split}.jsonl")[:150]
        items[task] = [audit.item_text(task, {"doc": doc}) for doc in docs]
    found = audit.audit_recovery_data(records, items)
    assert [t for t, row in found["tasks"].items() if row["flagged"] or row["either"]] == []
    assert all(row["examined"] == row["items"] == len(items[t]) for t, row in found["tasks"].items())


def test_every_item_is_examined_or_counted_with_why():
    """A short ARC question (no field of 25 characters) is examined on all its text; a sample without its document
    and a probe question outside its template are counted as not examined, with the reason (old code: dropped)."""
    short = {"id": "MCAS_2003_5_3", "question": "What causes sound?",
             "choices": {"text": ["sunlight", "vibrations", "x-rays", "pitch"], "label": ["A", "B", "C", "D"]},
             "answerKey": "B"}
    text = audit.item_text("arc_easy", {"doc": short})
    assert text == "What causes sound?\nsunlight\nvibrations\nx-rays\npitch"  # ids and labels left out
    records = [*PLAIN, {"prompt": "What causes sound? Sunlight, vibrations, X-rays, pitch.", "response": "Vibrations."}]
    found = audit.audit_recovery_data(records, {"arc_easy": [text, None, "A long enough question about plants here."],
                                                "copy_l3": ["Input: k d m\nCopy:", "Copy nothing:"]})["tasks"]
    arc = found["arc_easy"]
    assert (arc["items"], arc["examined"], arc["not_examined"], arc["whole"], arc["prompts"]) == (
        3, 2, {audit.NO_DOC: 1}, 1, 1)  # the 7-token question matched whole
    assert found["copy_l3"]["not_examined"] == {audit.NO_TEMPLATE: 1}
    assert "not examined: 1 question not in its family's template" in found["copy_l3"]["verdict"]
    line = audit_report.task_line("arc_easy", arc)
    assert "| 1 (no document in the samples log) |" in line


def _sweep_folder(root: Path, fingerprint: str, output: Path) -> None:
    root.mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"name": "s", "fingerprint": fingerprint,
                                               "recipe": {"name": "s", "output": str(output)}}))


def test_every_scored_task_is_audited_those_of_later_folders_too(tmp_path):
    """brackets_d6 was scored for the math-dolly sweep's models by an evaluate recipe into a folder laid out as the
    sweep's (its run.json, no teacher answers), and only `layerprune analyze sweeps` read it: the sweep's audit knew
    the tasks of its own eval/baseline alone. Now the join audits every task of every folder against the teacher
    answers of the recipe that made its models, and a sweep's audit covers every task any of its models was scored
    on."""
    sweep, addendum = tmp_path / "sweep", tmp_path / "addendum"
    _sweep_folder(sweep, "f1", sweep)
    _sweep_folder(addendum, "f1", sweep)
    brackets = probe_items("brackets_d6", 100)
    records = [*PLAIN, *({"prompt": p.question, "response": p.answer} for p in brackets[:5])]
    (sweep / "selfgen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_eval_samples(sweep, "arith_2d_sub", [{"prompt": p.prompt} for p in probe_items("arith_2d_sub", 20)])
    write_eval_samples(addendum, "brackets_d6", [{"prompt": p.prompt} for p in brackets])
    audits = audit.audit_runs([addendum])
    row = audits[str(addendum)]["tasks"]["brackets_d6"]
    assert (row["examined"], row["prompts"], row["flagged"]) == (100, 5, True)
    assert audits[str(addendum)]["source"] == str(sweep / "selfgen.jsonl")
    text = "\n".join(audit_report.join_audit_lines(audits))
    assert f"## Held out, measured: {addendum}" in text and "| brackets_d6 | 100 | 5 |" in text
    _sweep_folder(tmp_path / "stranger", "f2", sweep)  # another recipe's folder: not these teacher answers
    assert "error" in audit.audit_runs([tmp_path / "stranger"])[str(tmp_path / "stranger")]
    # a task scored for some of the sweep's models but not the original: audited from their folder
    later = sweep / "eval" / "pruned-k2" / "samples"
    later.mkdir(parents=True)
    (later / "brackets_d6.jsonl").write_text((addendum / "eval" / "baseline" / "samples" / "brackets_d6.jsonl")
                                             .read_text())
    found = audit.audit_study(sweep)
    assert set(found["tasks"]) == {"arith_2d_sub", "brackets_d6"} and found["tasks"]["brackets_d6"]["flagged"]
    assert found["items_from"] == {"arith_2d_sub": "eval/baseline", "brackets_d6": "eval/pruned-k2"}


def test_an_arm_trained_on_prompts_of_its_own_is_audited_too(tmp_path):
    """A sweep's positive control (arm_prompts: kd on arithmetic prompts, selfgen-kd-arith.jsonl) is audited against
    the same scored items as the shared answers: an item planted in its prompts is flagged there (and only there),
    and the section names the arm. (Before: only selfgen.jsonl was audited; the arm's data went unseen.)"""
    arith = probe_items("arith_2d_add", 20)
    (tmp_path / "selfgen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PLAIN))
    own = [{"prompt": p.prompt, "response": p.answer} for p in arith[:2]]
    (tmp_path / "selfgen-kd-arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
    write_eval_samples(tmp_path, "arith_2d_add", [{"prompt": p.prompt, "answer": p.answer} for p in arith])
    found = audit.audit_study(tmp_path, ["arith_2d_add"])
    assert not found["tasks"]["arith_2d_add"]["flagged"]
    arm = found["arms"]["kd-arith"]
    assert arm["tasks"]["arith_2d_add"]["flagged"] and arm["tasks"]["arith_2d_add"]["either"] == 2
    assert arm["records"] == 2 and arm["source"].endswith("selfgen-kd-arith.jsonl")
    text = "\n".join(audit_report.audit_lines(found))
    assert "Arm kd-arith, trained on answers to prompts of its own (2 records, selfgen-kd-arith.jsonl)" in text
    assert text.count("| task | items |") == 2
