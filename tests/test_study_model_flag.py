"""A shipped protocol on the user's own model (`--model X`) and a grid named by its file (`layerprune run GRID`,
`layerprune study GRID`, `--cell`): pipeline/recipe_cells.py, pipeline/on_model.py, cli/run.py, cli/study.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import assert_one_line_error, run_cli
from layerprune.core.settings import RunSettings
from layerprune.pipeline.recipe_cells import select_cells

SCORES = ("ablation", "bi", "reverse")


@pytest.fixture
def here(tmp_path, monkeypatch, shared_data) -> Path:
    """A clean working folder (default run directories land in runs/ under it) with the data mirror."""
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def written(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_naming_a_grid_lists_its_cells_and_dry_runs_each(capsys, here):
    code, out, err = run_cli(capsys, ["run", "limits-paper-b", "--dry-run"])
    assert code == 0, err
    head, _, plans = out.partition("\n== cell 1/18: ")
    assert head.startswith("grid 'limits-paper-b' (limits-paper-b.yaml): 18 cells over family x score x recovery")
    varying = next(line for line in head.splitlines() if line.startswith("varying: "))
    assert {"model", "prune.drop", "prune.score", "recover.recipe"} <= set(varying[9:].split(", "))
    assert "description" not in varying and "output" not in varying
    row = next(line for line in head.splitlines() if line.startswith("  limits-qwen25-7b-bi7-gsm8k-full "))
    assert "[family=qwen25-7b score=bi recovery=gsm8k-full]" in row and "prune.drop=7" in row
    assert "model=Qwen/Qwen2.5-7B-Instruct" in row and "recover.recipe=selfgen-gsm8k" in row
    assert out.count("recipe: valid") == 18 and "== cell 18/18: limits-qwen25-7b-reverse7-gsm8k-full" in out
    assert "run 'limits-mistral-7b-bi8' -> runs/limits-mistral-7b-bi8" in plans
    assert written(here) == []


def test_model_collapses_paper_b_s_family_axis_to_six_cells_on_a_quarter_of_its_blocks(capsys, here, tiny_llama):
    code, out, err = run_cli(capsys, ["run", "limits-paper-b", "--model", str(tiny_llama), "--dry-run"])
    assert code == 0, err
    names = [f"limits-{tiny_llama.name}-{score}2{tail}" for score in SCORES for tail in ("", "-gsm8k-full")]
    assert "18 cells" not in out and out.startswith("grid 'limits-paper-b' (limits-paper-b.yaml): 6 cells")
    assert (f"on model {tiny_llama} (6 blocks): prune.drop 2 (1/4 of its blocks, as in the recipe: llama31-8b 8 "
            "of 32, mistral-7b 8 of 32, qwen25-7b 7 of 28)") in out
    for index, name in enumerate(names, 1):
        assert f"== cell {index}/6: {name}\nrun '{name}' -> runs/{name}\n" in out
    assert out.count(f"model: {tiny_llama} (local") == 6 and "Llama-3.1" not in out.partition("== cell")[2]
    assert "minus 2 blocks" in out and written(here) == []


def test_a_cell_named_on_the_user_s_model_takes_its_label_s_share(capsys, here, tiny_llama):
    code, out, err = run_cli(capsys, ["run", "limits-qwen25-7b-bi7", "--model", str(tiny_llama), "--dry-run"])
    assert code == 0, err
    assert out.startswith(f"on model {tiny_llama} (6 blocks): prune.drop 2 (1/4 of its blocks, as in the recipe: "
                          "qwen25-7b 7 of 28)\nrun 'limits-llama-6-bi2' -> runs/limits-llama-6-bi2")


def test_cell_picks_cells_by_shipped_or_listed_name(capsys, here, tiny_llama):
    code, out, err = run_cli(capsys, ["run", "limits-paper-b", "--cell", "limits-qwen25-7b-bi7",
                                      "limits-mistral-7b-reverse8", "--dry-run"])
    assert code == 0, err
    assert "2 cells" in out and "== cell 1/2: limits-mistral-7b-reverse8" in out
    code, out, err = run_cli(capsys, ["run", "limits-paper-b", "--model", str(tiny_llama), "--cell",
                                      "limits-llama-6-bi2", "limits-llama31-8b-reverse8", "--dry-run"])
    assert code == 0, err
    assert "== cell 1/2: limits-llama-6-bi2\n" in out and "== cell 2/2: limits-llama-6-reverse2\n" in out


def test_the_share_rule_gives_back_the_shipped_qwen_cell_and_a_folder_of_its_own():
    """limits-sweep-7b-8b on Qwen2.5-7B-Instruct (28 blocks) by the rule derived from all three labels: the shipped
    qwen25-7b cell's counts (ratios 1, 2, 4, 6, 7: llama's cut below a quarter), in another run directory."""
    settings = RunSettings()
    (shipped,) = select_cells("limits-sweep-qwen25-7b", "sweep-study", settings).cells
    (moved,) = select_cells("limits-sweep-7b-8b", "sweep-study", settings, model="Qwen/Qwen2.5-7B-Instruct").cells
    assert moved.data["ratios"] == shipped.data["ratios"] == [1, 2, 4, 6, 7]
    assert moved.data["prune"] == shipped.data["prune"]
    assert moved.name == "limits-sweep-Qwen-Qwen2.5-7B-Instruct"
    assert moved.data["output"] == "runs/limits-sweep-Qwen-Qwen2.5-7B-Instruct" != shipped.data["output"]


def test_study_model_on_a_plain_recipe_keeps_its_counts_or_takes_drop(capsys, here, tiny_llama, tiny_models):
    deep = tiny_models("llama", 8)
    code, out, err = run_cli(capsys, ["study", "limits-sweep-embedded", "--model", str(deep), "--dry-run"])
    assert code == 0, err
    assert out.startswith(f"on model {deep} (8 blocks): prune.drop 6 (the recipe fixes it for every model)")
    assert "'limits-sweep-embedded--llama-8' -> runs/limits-sweep-embedded--llama-8" in out
    assert "cut at k = 1, 2, 3, 4, 6 blocks" in out
    code, _, err = run_cli(capsys, ["study", "limits-sweep-embedded", "--model", str(tiny_llama), "--dry-run"])
    assert_one_line_error(code, err, "has 6 blocks and the recipe removes up to 6", "--drop N")
    code, out, err = run_cli(capsys, ["study", "limits-sweep-embedded", "--model", str(tiny_llama), "--drop", "4",
                                      "--dry-run"])
    assert code == 0, err
    assert "prune.drop 4 (--drop)" in out and "cut at k = 1, 2, 3, 4 blocks" in out
    assert written(here) == []


def test_drop_keeps_a_run_order_of_the_cuts_still_there_and_runs_the_new_ones_after(capsys, here, tiny_models):
    from layerprune.pipeline.on_model import with_drop

    assert with_drop({"ratios": [2, 4], "run_order": [2, 0, 4], "prune": {"drop": 4}}, 6)["run_order"] == [2, 0, 4, 6]
    assert with_drop({"ratios": [2, 4], "run_order": [4, 0, 2], "prune": {"drop": 4}}, 3)["run_order"] == [0, 2, 3]
    assert with_drop({"run_order": [2, 0, 4]}, 6)["run_order"] == [2, 0, 4, 6]  # ratios set in a grid's label
    assert with_drop({"run_order": [4, 0, 2]}, 3) == {"run_order": [0, 2, 3]}
    code, out, err = run_cli(capsys, ["study", "limits-budget-math-embedded", "--model", str(tiny_models("llama", 8)),
                                      "--drop", "6", "--dry-run"])  # before: run_order [2, 0, 4] refused ratios 2, 4, 6
    assert code == 0, err
    assert "prune.drop 6 (--drop)" in out and "cut at k = 2, 4, 6 blocks" in out


def test_study_grid_on_the_user_s_model(capsys, here, tiny_llama):
    code, out, err = run_cli(capsys, ["study", "recovery-methods-7b-8b", "--model", str(tiny_llama), "--dry-run"])
    assert code == 0, err
    assert "1 cell over model" in out and "minus 2 blocks" in out
    assert "one-cut sweep (k = 2: a recovery study) 'recovery-methods-llama-6' -> runs/recovery-methods-llama-6" in out
    code, _, err = run_cli(capsys, ["study", "grain-study-embedded", "--model", str(tiny_llama), "--dry-run"])
    assert_one_line_error(code, err, "model axis 'model' sets classification, fixed", "--cell")
    code, _, err = run_cli(capsys, ["study", "grain-study-embedded", "--model", str(tiny_llama), "--cell",
                                    "grain-embedded", "--dry-run"])
    assert_one_line_error(code, err, "has 6 blocks and the recipe removes up to 6", "--drop N")
    assert written(here) == []


def model_grid(path: Path, models: dict[str, tuple[Path | str, int]]) -> Path:
    grid = {label: {"model": str(model), "prune": {"drop": drop}} for label, (model, drop) in models.items()}
    path.write_text(yaml.safe_dump({
        "kind": "run", "name": "mine-{family}", "prune": {"score": "last"}, "recover": None,
        "evaluate": {"tasks": ["arith_1dc"], "limit": 4}, "grid": {"family": grid}}))
    return path


def test_the_share_is_read_from_each_label_s_config_or_asked_for(capsys, here, tiny_models):
    six, four, eight = tiny_models("llama", 6), tiny_models("llama", 4), tiny_models("llama", 8)
    agree = model_grid(here / "agree.yaml", {"a": (six, 3), "b": (four, 2)})
    code, out, err = run_cli(capsys, ["run", str(agree), "--model", str(eight), "--dry-run"])
    assert code == 0, err
    assert "prune.drop 4 (1/2 of its blocks, as in the recipe: a 3 of 6, b 2 of 4)" in out
    differ = model_grid(here / "differ.yaml", {"a": (six, 3), "b": (four, 1)})
    code, _, err = run_cli(capsys, ["run", str(differ), "--model", str(eight), "--dry-run"])
    assert_one_line_error(code, err, "no one share of their blocks (3 of 6, 1 of 4)", "--drop N")
    unread = model_grid(here / "unread.yaml", {"a": ("some-org/not-on-this-machine", 3)})
    code, _, err = run_cli(capsys, ["run", str(unread), "--model", str(eight), "--dry-run"])
    assert_one_line_error(code, err, "cannot be read", "--drop N")
    code, out, err = run_cli(capsys, ["run", str(unread), "--model", str(eight), "--drop", "3", "--dry-run"])
    assert code == 0, err
    assert "run 'mine-llama-8' -> runs/mine-llama-8" in out
    assert sorted(p.name for p in written(here)) == ["agree.yaml", "differ.yaml", "unread.yaml"]


@pytest.mark.parametrize("argv, needles", [
    (["run", "limits-paper-b", "--cell", "limits-qwen25-7b-bi8"], ["unknown cell of limits-paper-b",
                                                                    "did you mean: limits-qwen25-7b-bi7"]),
    (["run", "limits-paper-b", "--model", "no/such/folder"], ["model path not found"]),
    (["run", "limits-paper-b", "--model", "embedded:nope"], ["unknown embedded model 'nope'"]),
    (["study", "limits-sweep-embedded", "--drop", "3"], ["--drop", "give it with --model"]),
    (["study", "limits-sweep-embedded", "--cell", "x"], ["'limits-sweep-embedded' is one recipe, not a grid"]),
    (["run", "limits-qwen25-7b-bi7", "--cell", "x"], ["already one cell of the grid limits-paper-b"]),
])
def test_bad_input_is_one_line_and_writes_nothing(capsys, here, argv, needles):
    code, _, err = run_cli(capsys, [*argv, "--dry-run"])
    assert_one_line_error(code, err, *needles)
    code, _, err = run_cli(capsys, argv)  # without --dry-run, refused before anything runs
    assert_one_line_error(code, err, *needles)
    assert written(here) == []


def test_a_recipe_naming_its_model_twice_is_refused(capsys, here, tiny_llama, tiny_models):
    path = here / "twice.yaml"
    path.write_text(yaml.safe_dump({
        "kind": "run", "name": "twice", "model": str(tiny_llama), "prune": {"drop": 1, "score": "last"},
        "recover": {"recipe": "demo", "overrides": {"teacher": str(tiny_llama)}}}))
    code, _, err = run_cli(capsys, ["run", str(path), "--model", str(tiny_models("llama", 8)), "--dry-run"])
    assert_one_line_error(code, err, f"names its model '{tiny_llama}' also at recover.overrides.teacher")


TINY_GRID = {
    "kind": "run", "name": "tinygrid-{cut}", "output": "{name}-out", "prune": {"score": "last"}, "recover": None,
    "evaluate": {"tasks": ["arith_1dc"], "limit": 4, "batch_size": "4"},
    "grid": {"cut": {"one": {"prune": {"drop": 1}}, "two": {"prune": {"drop": 2}}}},
}


def test_a_grid_runs_each_cell_in_turn_and_each_resumes_on_its_own(capsys, here, tiny_llama, caplog):
    path = here / "tinygrid.yaml"
    path.write_text(yaml.safe_dump({**TINY_GRID, "model": str(tiny_llama)}))
    code, out, err = run_cli(capsys, ["run", str(path), "--cell", "tinygrid-two", "--dry-run"])
    assert code == 0, err
    assert "1 cell over cut" in out and "varying: nothing" in out and not (here / "tinygrid-two-out").exists()
    code, out, err = run_cli(capsys, ["run", str(path)])
    assert code == 0, err
    assert "cell 1/2: tinygrid-one -> tinygrid-one-out" in out and "cell 2/2: tinygrid-two -> tinygrid-two-out" in out
    for name, kept in (("one", 5), ("two", 4)):
        report = (here / f"tinygrid-{name}-out" / "report.md").read_text()
        assert "arith_1dc" in report and f"Blocks 6 -> {kept}" in report
    before = {p: p.stat().st_mtime_ns for p in written(here)}
    caplog.clear()
    with caplog.at_level("INFO"):
        code, _, err = run_cli(capsys, ["run", str(path)])
    assert code == 0, err
    assert caplog.text.count("complete, skipped") >= 2 * 4  # every stage of both cells kept
    assert {p: p.stat().st_mtime_ns for p in written(here)} == before
