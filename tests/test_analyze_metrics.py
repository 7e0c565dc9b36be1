"""Pure measures of `analyze`, against values computed by hand."""

from __future__ import annotations

import math

import pytest

from layerprune.analyze import metrics
from layerprune.analyze.tasks import clean_gsm8k_solution, task_items
from layerprune.tasks.grading import final_number


def test_rep_n_counts_repeated_ngrams():
    tokens = "a b a b".split()
    assert metrics.rep_n(tokens, 2) == pytest.approx(1 / 3)  # ab, ba, ab: 2 unique of 3
    assert metrics.rep_n(tokens, 3) == 0.0  # aba, bab
    assert metrics.rep_n(tokens, 5) is None


def test_words_split_punctuation_and_lowercase():
    assert metrics.words("The cat, sat.") == ["the", "cat", ",", "sat", "."]


def test_self_bleu_by_hand():
    # words: [the cat sat on .] vs [the cat sat here .], both ways: p1 = 4/5, p2 = 2/4, p3 = 1/3,
    # p4 = 0/2 -> floored to 0.1/2; equal lengths -> no brevity penalty
    expected = (0.8 * 0.5 * (1 / 3) * 0.05) ** 0.25
    assert metrics.self_bleu("The cat sat on. The cat sat here.") == pytest.approx(expected)


def test_self_bleu_short_sentence_uses_its_own_orders_and_brevity_penalty():
    # [the cat .] vs [the cat sat on .]: orders 1-3 only (effective order), p1 = 3/3, p2 = 1/2, p3 = 0 -> 0.1/1,
    # BP = exp(1 - 5/3); the other way p1 = 3/5, p2 = 1/4, p3 = 0.1/3, p4 = 0.1/2, no penalty
    short = math.exp(1 - 5 / 3) * (1 * 0.5 * 0.1) ** (1 / 3)
    long = (0.6 * 0.25 * (0.1 / 3) * (0.1 / 2)) ** 0.25
    assert metrics.self_bleu("The cat. The cat sat on.") == pytest.approx((short + long) / 2)


def test_self_bleu_within_one_response():
    assert metrics.self_bleu("A b c d. A b c d.") == pytest.approx(1.0)
    assert metrics.self_bleu("Only one sentence here.") is None
    assert metrics.split_sentences("One. Two!\nThree") == ["One.", "Two!", "Three"]


def test_degeneration_stats_means_over_defined_values():
    stats = metrics.degeneration_stats(["a b a b", "x"])
    assert stats["rep_2"] == pytest.approx(1 / 3)  # "x" has no bigram: left out of the mean
    assert stats["mean_length_words"] == pytest.approx(2.5)
    assert stats["self_bleu_4"] is None and stats["responses"] == 2


def test_drops_and_critical_blocks():
    assert metrics.relative_drops(0.5, [0.4, 0.6]) == pytest.approx([0.2, -0.2])
    assert metrics.relative_drops(0.0, [0.1]) == [0.0]
    assert metrics.critical_blocks([0.1, 0.25, 0.2, 0.3], 0.2) == [1, 3]
    assert metrics.answer_probability(math.log(2)) == pytest.approx(0.5)


def test_spearman_by_hand():
    # rank differences 0, 1, 1, 0 -> rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert metrics.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert metrics.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: x ranks 1, 2.5, 2.5, 4 -> Pearson of ranks with 1, 2, 3, 4 = 4.5 / sqrt(4.5 * 5)
    assert metrics.spearman([10, 20, 20, 30], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert metrics.spearman([1, 1, 1], [1, 2, 3]) is None and metrics.spearman([1], [2]) is None


def test_jaccard():
    assert metrics.jaccard({1, 2}, {2, 3}) == pytest.approx(1 / 3)
    assert metrics.jaccard([], [4]) == 0.0
    assert metrics.jaccard([], []) is None


def test_relative_depth_alignment():
    # rows at (r + 0.5) / 6 of a 4-block model: 0.33, 1.0, 1.67, 2.33, 3.0, 3.67 -> blocks 0 1 1 2 3 3
    assert metrics.relative_depth_map(4, 6) == [0, 1, 1, 2, 3, 3]
    assert metrics.relative_depth_map(5, 5) == [0, 1, 2, 3, 4]
    assert metrics.align_by_depth([0.0, 1.0, 2.0, 3.0], 6) == [0.0, 1.0, 1.0, 2.0, 3.0, 3.0]
    assert metrics.align_blocks([1], 4, 6) == {1, 2}


def test_elbow_is_largest_drop():
    assert metrics.largest_drop([1.0, 0.9, 0.5, 0.45]) == 2
    assert metrics.largest_drop([1.0]) is None


def test_answer_extraction():
    assert final_number("so 3 + 4\n#### 1,234") == "1234"
    assert final_number("It is 7. The answer is 42.") == "42"
    assert final_number("3 and 5") == "5"


def test_gsm8k_solution_cleaning():
    text, final = clean_gsm8k_solution("He has 2+3 = <<2+3=5>>5 apples.\n#### 5")
    assert (text, final) == ("He has 2+3 = 5 apples.\nThe answer is 5.", "5")


def test_factual_task_is_offline_and_seeded():
    items = task_items("factual", 5, seed=1, shots=2, data_dir=None)
    assert len(items) == 5 and items == task_items("factual", 5, seed=1, shots=2, data_dir=None)
    assert items[0].prompt.count("Q: What is the capital of") == 3 and items[0].target.startswith(" ")


def test_study_degeneration_drops_short_sentences_and_reports_x100():
    text = "The cat sat on the mat. The cat sat on the mat. Yes."  # "Yes ." has 2 tokens: dropped
    assert metrics.study_self_bleu(text) == pytest.approx(100.0)
    assert metrics.self_bleu(text) < 1.0  # the usual definition keeps "yes ." and scores it
    assert metrics.study_self_bleu("The cat sat on the mat. Yes. No.") is None  # one sentence left
    assert metrics.study_tokens("isn't it") == ["is", "n't", "it"]
    stats = metrics.study_degeneration_stats(["a b a b"])
    assert stats["study_rep_2"] == pytest.approx(100 / 3) and stats["study_self_bleu_4"] is None
