"""Graders of `analyze` generations (layerprune.tasks.grading) and the per-item statistics of ablation drops."""

from __future__ import annotations

import numpy as np
import pytest

from layerprune.analyze.tasks import ANALYSIS_TASKS, TaskItem, triviaqa_answer
from layerprune.core import paired as stats
from layerprune.tasks.grading import final_number, grade_number, grade_short_answer, numbers_equal, triviaqa_cut


def gsm8k(answer: str) -> TaskItem:
    return TaskItem("Question: ...\nAnswer:", " ...", answer)


def test_gsm8k_numbers_are_equal_as_numbers():
    grade = ANALYSIS_TASKS.get("gsm8k").grade
    assert grade("She pays 6 * 3 = 18.00 dollars.\nThe answer is 18.00", gsm8k("18"))
    assert grade("It costs $1,000.", gsm8k("1000"))
    assert grade("#### 18.", gsm8k("18"))
    assert grade("</think> So 18.0 apples. \\(\\boxed{18.0}\\) then 7", gsm8k("18"))
    assert not grade("The answer is 18.5", gsm8k("18"))
    assert numbers_equal("-3.0", "-3") and not numbers_equal("", "0") and not numbers_equal("abc", "abc")


def test_gsm8k_answer_is_cut_at_a_new_turn():
    text = "5 + 13 = 18. The answer is 18.\n\nQuestion: Tom has 4 apples...\nAnswer: The answer is 4."
    assert final_number(text) == "18" and grade_number(text, "18")
    assert grade_number("So 18 in all.\nHuman: and now 7?\nAssistant: 7", "18")
    assert not grade_number("Question: what is 3 + 4?\nThe answer is 18", "18")  # nothing before the turn


def test_arithmetic_reads_the_first_number_of_the_first_line():
    grade = ANALYSIS_TASKS.get("arithmetic").grade
    assert grade(" 19\nQ: 3 + 4 = 7", TaskItem("12 + 7 =", " 19", "19"))
    assert grade(" 19.0 is the result", TaskItem("12 + 7 =", " 19", "19"))
    assert not grade(" 7\n19", TaskItem("12 + 7 =", " 19", "19"))


def test_short_answers_as_lm_eval_triviaqa_grades_them_over_every_alias():
    grade = ANALYSIS_TASKS.get("triviaqa").grade
    item = TaskItem("Q: Capital of France?\nA:", " Paris", "Paris", ("Paris", "Paris, France", "Ville de Paris"))
    assert grade(" paris.", item) and grade(" Paris, the city of light", item) and grade("PARIS!", item)
    assert grade(" Ville de Paris\n", item)  # another alias
    assert grade(" The capital of France is Paris.", item)  # whole-word containment (chat answers)
    assert not grade(" Parisian food", item) and not grade(" Lyon", item)
    assert triviaqa_cut("  Paris, France.") == "Paris"  # lm-eval's until: "\n", ".", ","
    assert grade_short_answer(" U.S.A.", ["USA"])  # punctuation ignored, like lm-eval's exact_match
    assert grade("<think>France... Lyon? No.</think>\nThe answer is \\boxed{Paris}.", item)  # reasoning models
    assert not grade("<think>Paris? No.</think> \\boxed{Lyon}", item)


def test_triviaqa_rows_keep_every_alias():
    row = {"question": "q", "answer": {"value": "Paris", "aliases": ["Paris", "Ville de Paris"]}}
    assert triviaqa_answer(row) == ("Paris", ("Paris", "Ville de Paris"))
    assert triviaqa_answer({"question": "q", "answer": "Rome"}) == ("Rome", ("Rome",))


def test_a_drop_is_critical_only_when_above_threshold_and_significant():
    base = [1.0] * 40
    big = [0.0] * 20 + [1.0] * 20  # drop 0.5 on 40 items: far from 0
    small = [0.0] * 2 + [1.0] * 38  # drop 0.05: significant-ish but below threshold
    none = [1.0] * 40
    result = stats.block_statistics(base, [big, small, none], "mean", threshold=0.2, resamples=2000)
    assert result["drops"] == pytest.approx([0.5, 0.05, 0.0])
    low, high = result["intervals"][0]
    assert 0.3 < low < 0.5 < high < 0.7 and result["significant"][0]
    assert result["critical"] == [0]
    assert result["p_values"][2] == 1.0 and not result["significant"][2]


def test_a_large_drop_on_few_items_is_not_significant():
    # 3 of 4 items right in full, 2 of 4 with the block skipped: drop 1/3 > 0.2, but one item decides it
    result = stats.block_statistics([1, 1, 1, 0], [[1, 0, 1, 0]], "mean", threshold=0.2, resamples=2000)
    assert result["drops"] == pytest.approx([1 / 3])
    assert result["intervals"][0][0] <= 0 and not result["significant"][0] and result["critical"] == []


def test_drops_are_undefined_when_the_full_model_scores_near_zero():
    result = stats.block_statistics([0.0] * 30 + [1.0], [[0.0] * 31, [1.0] * 31], "mean", threshold=0.2)
    assert result["drops"] == [None, None] and result["critical"] == [] and "min_base_score" in result["undefined"]


def test_probability_score_resamples_items_with_their_token_counts():
    nll, tokens = [np.log(2) * 2, np.log(4) * 1], [2, 1]  # per-item NLL sums: p = exp(-(2 ln2 + ln4) / 3)
    result = stats.block_statistics(nll, [[0.0, 0.0]], "probability", threshold=0.2, tokens=tokens,
                                    min_base_score=0.0)
    base = np.exp(-(2 * np.log(2) + np.log(4)) / 3)
    assert result["base_score"] == pytest.approx(base) and result["drops"] == pytest.approx([(base - 1) / base])


def blobs(rng, labels, spread=0.05, dims=8):
    centers = rng.normal(size=(labels.max() + 1, dims)) * 3
    return centers[labels] + rng.normal(scale=spread, size=(len(labels), dims))


def test_nmi_on_synthetic_clusters_with_known_structure():
    from layerprune.analyze.nmi import nmi_over_depth

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 60)
    same = blobs(rng, labels)
    moved = blobs(rng, labels)  # the same grouping at other places: still NMI 1
    merged = blobs(rng, labels // 2)  # clusters merged pairwise: half the information
    noise = rng.normal(size=(240, 8))  # no structure: AMI about 0
    series = nmi_over_depth([same, moved, merged, noise], k=4, seed=0, normalize=False, seeds=3)
    assert series["nmi"][0] == pytest.approx(1.0) and series["nmi"][1] == pytest.approx(1.0)
    # 4 equal clusters vs their pairwise merge (k-means splits each merged pair in 2 at random):
    assert 0.4 < series["nmi"][2] < 0.9 and series["nmi"][3] < 0.1
    assert abs(series["ami"][3]) < 0.03 and series["ami"][1] == pytest.approx(1.0)
    assert series["seed_agreement"][0] == pytest.approx(1.0) and series["seed_agreement"][3] < 0.9
    assert all(lo <= m <= hi for lo, m, hi in zip(series["nmi_min"], series["nmi"], series["nmi_max"], strict=False))


def test_nmi_of_the_reference_is_measured_not_assumed():
    from layerprune.analyze.nmi import nmi_over_depth

    noise = np.random.default_rng(1).normal(size=(300, 8))  # k-means of noise depends on the seed
    series = nmi_over_depth([noise, noise], k=6, seed=0, normalize=False, seeds=2)
    assert series["nmi"][0] < 0.95 and series["nmi"][0] == series["nmi"][1]


def test_elbow_leaves_the_first_step_out_and_measures_its_distance_to_critical_blocks():
    from layerprune.analyze import metrics
    from layerprune.analyze.nmi import elbow_report

    series = {"nmi": [0.98, 0.5, 0.45, 0.2, 0.18], "seed_agreement": [0.98, 0.95, 0.96, 0.97, 0.97]}
    report = elbow_report(series, critical=[0, 5])
    assert report["elbow_block"] == 2 and report["elbow_nmi_drop"] == pytest.approx(0.25)  # state 3 = after block 2
    assert report["first_step_drop"] == pytest.approx(0.48) and report["elbow_distance_to_critical"] == 2
    assert report["clustering_noise"] == pytest.approx(0.05) and report["elbow_above_noise"]
    assert metrics.largest_drop([1.0, 0.5, 0.45]) == 1 and metrics.largest_drop([1.0, 0.5], start=2) is None


def test_pos_nmi_tracks_the_groups_and_sits_above_its_chance_floor():
    from layerprune.analyze.nmi import nmi_over_depth

    rng = np.random.default_rng(2)
    groups = np.repeat(np.arange(4), 60)
    names = np.array(["NN", "VB", "JJ", "DT"])[groups]
    pos = [None if i % 10 == 0 else str(name) for i, name in enumerate(names)]  # untagged tokens are left out
    syntactic = blobs(rng, groups)  # clusters = the groups
    lexical = rng.normal(size=(240, 8))  # no relation to the groups
    series = nmi_over_depth([syntactic, lexical], k=4, seed=0, normalize=False, seeds=3, pos=pos)
    assert series["pos_nmi"][0] == pytest.approx(1.0) and series["pos_ami"][0] == pytest.approx(1.0)
    assert series["pos_nmi"][1] < 0.1 and abs(series["pos_ami"][1]) < 0.03
    assert all(chance < 0.1 for chance in series["pos_nmi_chance"])  # shuffled groups: what chance scores here
    assert "pos_nmi" not in nmi_over_depth([syntactic], k=4, seed=0, normalize=False, seeds=2)


def test_pos_groups_follow_the_tokens_walk_scores(tiny_llama):
    pytest.importorskip("textblob")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from layerprune.analyze.nmi import count_tokens
    from layerprune.analyze.pos import item_groups, token_groups
    from layerprune.analyze.walk import build_batches

    words = "<s> The cat sat on the mat . She sold 48 red clips".split()
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    whole_words = PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token="<s>")
    item = TaskItem("The cat sat on the mat.", " She sold 48 red clips", "")
    groups = item_groups(whole_words, item, 256)
    assert groups == [None, "DT", "NN", "VB", "PP", "DT", "NN", ".", "PR", "VB", "NO", "JJ", "NN"]  # None: BOS
    assert item_groups(whole_words, item, 4) == [".", "PR", "VB", "NO"]  # cut as walk.encode_item cuts

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)  # subword pieces: each takes its word's group
    items = [item, TaskItem("Q: What is the capital of France?\nA:", " Paris", ""), item]
    for max_length in (256, 6):  # the cut from the left, as walk.encode_item cuts
        batches = build_batches(tokenizer, items, 2, max_length)
        assert len(token_groups(tokenizer, items, max_length)) == count_tokens(batches)



def test_brackets_levels_are_importance_tasks_with_the_probes_items_and_exact_grading():
    """A variant that learned brackets is measured on them: the analysis items are the evaluation probes' own, and a
    generation is right only when its first line closes the sequence exactly."""
    from layerprune.analyze.tasks import task_items
    from layerprune.tasks.probes import generate_probes, probe_tasks

    items = task_items("brackets_mix", 5, 0, 1, None)
    probes = generate_probes(probe_tasks()["brackets_mix"], 5, 0)
    assert [(i.prompt, i.target) for i in items] == [(p.prompt, p.answer) for p in probes]
    task = ANALYSIS_TASKS.get("brackets_d3")
    item = task_items("brackets_d3", 1, 0, 1, None)[0]
    assert task.grade(f"{item.answer}\nSequence: ( [", item) and not task.grade(f"{item.answer} )", item)
    assert "\n" in task.stops and task.kind == "brackets"
