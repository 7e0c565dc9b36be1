"""Recipes check values against their registries, not only keys: a misspelled name fails with the close matches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from layerprune.analyze.schemas import NmiAnalysis
from layerprune.cli import main
from layerprune.evaluate.schema import EvalSettings
from layerprune.prune.recipe import PruneRecipe
from layerprune.recover.schema import RecoverRecipe

RUN = {"name": "t", "model": "embedded", "prune": {"drop": 2, "score": "ablation", "calib": "arithmetic"},
       "recover": None, "evaluate": {"suite": "quick"}}
RECOVER = {"name": "t", "prompts": {"source": "gsm8k"}}
IMPORTANCE = {"models": ["embedded"], "tasks": ["arithmetic"]}


def with_value(base: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of `base` with the field at `dotted` ('prune.score') set to `value`."""
    recipe = yaml.safe_load(yaml.safe_dump(base))
    *sections, key = dotted.split(".")
    node = recipe
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value
    return recipe


def validate(capsys, tmp_path: Path, kind: str, recipe: dict[str, Any]) -> tuple[int, str]:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main(["recipes", "validate", str(path), "--kind", kind])
    return code, capsys.readouterr().err


BAD_VALUES = [  # kind, base recipe, field, misspelled value, what the error must name, the suggestion
    ("run", RUN, "prune.score", "ablaton", "prune.score: unknown score 'ablaton'", "did you mean: ablation"),
    ("run", RUN, "prune.calib", "gsm8k+arithmetc", "prune.calib: unknown calibration source 'arithmetc'",
     "did you mean: arithmetic"),
    ("run", RUN, "prune.calib", "gsm8", "prune.calib: unknown calibration source 'gsm8'", "did you mean: gsm8k"),
    ("run", RUN, "prune.metric", "accuarcy", "prune.metric: unknown metric 'accuarcy'", "did you mean: accuracy"),
    ("run", RUN, "evaluate.suite", "quik", "evaluate.suite: unknown suite 'quik'", "did you mean: quick"),
    ("run", RUN, "evaluate.tasks", ["arith_1dc", "reasoning"], "evaluate.tasks: 'reasoning' is a suite",
     "use --suite reasoning"),
    ("run", RUN, "recover", {"recipe": "demo", "overrides": {"train": {"lr_scheduler": "linaer"}}},
     "train.lr_scheduler: unknown learning-rate scheduler 'linaer'", "did you mean: linear"),
    ("recover", RECOVER, "prompts.source", "dolyy", "prompts.source: unknown prompt set 'dolyy'",
     "did you mean: dolly"),
    ("recover", RECOVER, "prompts.source", "probes:arith_2d_ad+brackets_d3",
     "prompts.source: unknown probe task 'arith_2d_ad'", "did you mean: arith_2d_add"),
    ("recover", RECOVER, "train.lr_scheduler", "cosin", "train.lr_scheduler: unknown learning-rate scheduler 'cosin'",
     "did you mean: cosine"),
    ("recover", RECOVER, "method", "lorra", "method: unknown method 'lorra'", "did you mean: lora"),
    ("importance", IMPORTANCE, "tasks", ["arithmetic", "trivaqa"], "tasks: unknown task 'trivaqa'",
     "did you mean: triviaqa"),
    ("importance", IMPORTANCE, "metric", "generat", "metric: unknown metric 'generat'", "did you mean: generate"),
]


@pytest.mark.parametrize("kind, base, field, value, names, suggestion", BAD_VALUES,
                         ids=[f"{case[0]}-{case[2]}-{i}" for i, case in enumerate(BAD_VALUES)])
def test_a_misspelled_value_is_one_line_naming_the_field_and_the_right_name(capsys, tmp_path, kind, base, field,
                                                                              value, names, suggestion):
    assert validate(capsys, tmp_path, kind, base)[0] == 0  # the recipe is fine but for the one value
    code, err = validate(capsys, tmp_path, kind, with_value(base, field, value))
    assert code == 2
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert names in err and suggestion in err, err


@pytest.mark.parametrize("calib", ["auto", "gsm8k+arithmetic", "text", "auto+arithmetic", "mine.jsonl"])
def test_every_calibration_form_prune_reads_is_accepted(calib):
    assert PruneRecipe(drop=1, calib=calib).calib == calib


def test_a_calibration_file_is_accepted_by_path(tmp_path):
    path = tmp_path / "calib.txt"  # not .jsonl: load_calibration reads any existing file as JSONL
    path.write_text('{"text": "a"}\n')
    assert PruneRecipe(drop=1, calib=f"arithmetic+{path}").calib.endswith("calib.txt")
    with pytest.raises(ValueError, match="unknown calibration source"):
        PruneRecipe(drop=1, calib=str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("source", ["gsm8k", "dolly", "alpaca_seed", "probes", "probes:arith_1dc+brackets_d3",
                                    "my_prompts.jsonl"])
def test_every_prompt_source_recover_reads_is_accepted(source):
    assert RecoverRecipe.model_validate({"prompts": {"source": source}}).prompts.source == source


def test_nmi_calibration_task_is_checked():
    with pytest.raises(ValueError, match="(?s)calib.*did you mean: gsm8k"):
        NmiAnalysis(calib="gsm8")
    assert NmiAnalysis(calib="factual").calib == "factual"


def test_registered_task_names_and_patterns_need_no_lm_eval_index(monkeypatch):
    from layerprune.evaluate import lm_eval_index

    def no_index(*args: object) -> None:
        raise RuntimeError("lm-eval's index was read")

    monkeypatch.setattr(lm_eval_index, "task_manager", no_index)
    settings = EvalSettings(tasks=["arith_1dc", "gsm8k", "leaderboard_bbh_*"], suite="reasoning")
    assert settings.tasks == ["arith_1dc", "gsm8k", "leaderboard_bbh_*"]
    with pytest.raises(ValueError, match="'quick' is a suite"):
        EvalSettings(tasks=["quick"])


def test_task_names_are_checked_against_lm_evals_index_and_the_include_path(tmp_path):
    folder = tmp_path / "my_tasks"
    folder.mkdir()
    (folder / "parity.yaml").write_text("task: my_parity\ndataset_path: json\noutput_type: multiple_choice\n"
                                        "test_split: test\ndoc_to_text: q\ndoc_to_choice: [a, b]\ndoc_to_target: 0\n")
    assert EvalSettings(tasks=["lambada_openai", "my_parity"], include_path=folder).tasks
    with pytest.raises(ValueError, match="unknown task 'my_parity'") as info:
        EvalSettings(tasks=["my_parity"])  # only the folder defines it
    assert info.value.errors()[0]["loc"] == ("tasks",)
    with pytest.raises(ValueError, match="did you mean: arc_easy"):
        EvalSettings(tasks=["arc_esay"])
