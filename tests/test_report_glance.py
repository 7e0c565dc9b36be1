"""report.md's lead table: what each task measures, the three scores, the share won back with its interval."""

from __future__ import annotations

import yaml

from layerprune.pipeline.recipe import RunRecipe
from layerprune.pipeline.report import recipe_yaml
from layerprune.pipeline.report_glance import glance_table, task_measure

ROLES = ["baseline", "pruned", "recovered"]


def _row(task: str, kind: str, values: tuple[float, float, float], share: dict | None, clear: bool = True) -> dict:
    row = {"task": task, "kind": kind, "metric": "acc", "n": dict.fromkeys(ROLES, 100), "settings_differ": {},
           "clear_drop": clear, "recovered_share": None if share is None else share["value"],
           "intervals": {} if share is None else {"recovered_share": share}}
    row.update(zip(ROLES, values, strict=True))
    return row


def test_probe_families_are_named_for_what_they_measure_and_copying_is_retrieval():
    assert task_measure("arith_2d_add", "generative") == "arithmetic"
    assert task_measure("brackets_mix", "generative") == "brackets"
    assert task_measure("brackets_d4", "generative") == "brackets"
    assert task_measure("copy_l7", "generative") == "retrieval (copy)"
    assert task_measure("gsm8k", "generative") == "math word problems"
    assert task_measure("arc_easy", "classification") == "classification"


def test_the_table_gives_scores_in_percent_and_the_share_won_back_with_its_interval():
    rows = [_row("arith_2d_add", "generative", (0.6, 0.2, 0.35), {"value": 0.375, "low": 0.2, "high": 0.55}),
            _row("arc_easy", "classification", (0.7, 0.69, 0.7), None, clear=False)]
    table = glance_table(rows, [], ROLES).splitlines()
    assert table[0] == "| task | measures | n | original | pruned | recovered | won back [95%] |"
    assert table[2] == "| arith_2d_add | arithmetic | 100 | 60.0 | 20.0 | 35.0 | 37.5% [20.0, 55.0] |"
    assert table[3] == "| arc_easy | classification | 100 | 70.0 | 69.0 | 70.0 | no clear drop |"


def test_without_a_recovered_model_there_is_no_won_back_column():
    rows = [_row("copy_l7", "generative", (0.9, 0.5, 0.0), None)]
    for row in rows:
        del row["recovered"]
    table = glance_table(rows, [], ["baseline", "pruned"]).splitlines()
    assert table[0] == "| task | measures | n | original | pruned |"
    assert table[2] == "| copy_l7 | retrieval (copy) | 100 | 90.0 | 50.0 |"


def test_the_recipe_is_printed_as_yaml_that_reads_back_to_the_same_recipe():
    recipe = RunRecipe.model_validate({"name": "r", "model": "embedded", "prune": {"drop": 2}})
    text = recipe_yaml(recipe)
    assert text.startswith("name: r\n") and "{" not in text.splitlines()[0]
    assert RunRecipe.model_validate(yaml.safe_load(text)) == recipe
