"""One final-number extractor (layerprune.tasks.grading.final_number) for every stage; the cases where the three
extractors it replaced disagreed (prune.calib.extract_last_number, recover.selfgen.final_number)."""

from __future__ import annotations

import json

import pytest

from layerprune.analyze.tasks import clean_gsm8k_solution
from layerprune.prune.calib import jsonl_calib
from layerprune.recover import selfgen
from layerprune.recover.schema import PromptSource
from layerprune.tasks.grading import final_number, grade_number


@pytest.mark.parametrize("text, expected", [
    ("so she has 1,234 apples.\n#### 1,234", "1234"),  # GSM8K '####', thousands separators
    (" 55\n3 + 4", "4"),  # else the last number
    ("#### -5", "-5"),
    ("it fell to -3 degrees", "-3"),  # the sign is kept
    ("The total is 18.", "18"),  # a trailing '.' is not part of the number
    ("It costs $1,000.", "1000"),
    ("so 1,234.0 apples", "1234.0"),  # selfgen's dropped '.0'; grade_number compares as numbers
    ("\\boxed{18}, from 3 apples", "18"),  # the boxed answer first (calib and selfgen: 3)
    ("The answer is 42. Next time 7", "42"),  # 'the answer is N' (calib and selfgen: 7)
    ("#### 72\nThe next one has 5", "72"),  # '####' wins over later numbers (calib and selfgen: 5)
    ("18\nQuestion: what is 3 + 4?", "18"),  # the model's own next turn is cut (calib and selfgen: 4)
    ("no number", ""),  # calib and selfgen: None
])
def test_final_number(text, expected):
    assert final_number(text) == expected


def test_numbers_compare_as_numbers():
    assert grade_number("so 1,234.0 apples", "1234") and grade_number("#### 18.00", "18")
    assert not grade_number("no number", "0") and not grade_number("18.5", "18")


def test_selfgen_grades_the_final_answer():
    assert selfgen.is_correct("\\boxed{18}. Check: 3 + 15 = 18, then 2 more", "18")  # was: last number 2
    assert selfgen.is_correct("The answer is 7.\n\nQuestion: and 3 + 5?", "7")  # was: 5
    assert not selfgen.is_correct("It is 7", None) and not selfgen.is_correct("none", "7")
    row = {"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 1,007"}
    prompt = selfgen._to_prompt(row, PromptSource(source="gsm8k"))
    assert prompt is not None and prompt.answer == "1007"


def test_calibration_answers_read_through_grading(tmp_path):
    rows = [{"prompt": "Q1", "answer": "\\boxed{18} (3 steps)"}, {"prompt": "Q2", "answer": "#### 1,234"},
            {"prompt": "Q3", "answer": "The answer is 5. Then 6"}, {"prompt": "Q4", "answer": "no number"}]
    path = tmp_path / "calib.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = {item.prompt: item.expected for item in jsonl_calib(path, 10, 0).items}
    assert expected == {"Q1": "18", "Q2": "1234", "Q3": "5", "Q4": None}  # was: 3, 1234, 6, None


def test_gsm8k_solution_for_analysis():
    assert clean_gsm8k_solution("He has 2+3 = <<2+3=5>>5 apples.\n#### 1,005") == (
        "He has 2+3 = 5 apples.\nThe answer is 1005.", "1005")
