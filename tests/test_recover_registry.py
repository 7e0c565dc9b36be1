"""Recovery methods are a registry: a new method is one module (here, one in the test) and runs end to end; an unknown
name fails with the close matches; every method declares whether it holds the teacher and a memory plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from helpers import assert_one_line_error, pruned_copy, run_cli
from layerprune.models import load_model
from layerprune.recover.job import RecoverJob, TrainResult
from layerprune.recover.memory import MemoryPlan
from layerprune.recover.methods import (
    METHODS,
    MethodRun,
    PlanRequest,
    held_out_ids,
    plan_for,
    plan_training,
    recovery_method,
)
from layerprune.recover.schema import RecoverRecipe, Section

FAST = ["--max-new-tokens", "6", "--no-generate-drop-truncated", "--samples", "8", "--train-max-length", "64",
        "--held-out", "0.25", "--device", "cpu", "-q"]


@pytest.fixture
def pruned(tiny_models, tmp_path) -> Path:
    return pruned_copy(tiny_models("llama", 6), tmp_path / "pruned", [2, 3])


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i} + 7?"}) + "\n" for i in range(12)))
    return path


@pytest.fixture
def scale(monkeypatch):
    """A toy method, registered for this test only: it doubles the final norm's weight and trains nothing."""
    monkeypatch.setattr(METHODS, "_items", dict(METHODS._items))

    def plan_scale(request: PlanRequest) -> tuple[str, MemoryPlan]:
        return plan_training(request, "full")

    @recovery_method("scale", needs_teacher=False, plan=plan_scale)
    def scale_norm(run: MethodRun) -> TrainResult:
        loaded = load_model(run.student, run.job.settings)
        with torch.no_grad():
            loaded.model.model.norm.weight.mul_(2)
        saved = run.job.work / "final"
        loaded.model.save_pretrained(saved)
        loaded.tokenizer.save_pretrained(saved)
        optimizer, plan = plan_for(run.recipe, loaded.model.config, run.job, cuda=False)
        held = held_out_ids(run.prompts, run.recipe.train.held_out, run.job.settings.seed)
        return TrainResult(saved, None, None, {"train": []}, plan, optimizer, {"scaled": "model.norm.weight"}, 0.0, 0,
                           eval_rows=[r for r in run.rows if r["id"] in held], held_ids=held)

    return scale_norm


def test_a_method_registered_in_one_place_runs_recover_end_to_end(scale, pruned, prompts_file, tmp_path, capsys):
    out = tmp_path / "scaled"
    code, _, err = run_cli(capsys, ["recover", "--model", str(pruned), "--prompts", str(prompts_file), "-o", str(out),
                                    "--method", "scale", *FAST])
    assert code == 0, err
    report = json.loads((out / "recover_report.json").read_text())
    assert report["recipe"]["method"] == "scale" and report["data"]["scaled"] == "model.norm.weight"
    assert report["memory_plan"]["method"] == "scale" and report["memory_plan"]["teacher"] == 0
    assert report["held_out_metrics"]["after"]["ce"] > 0  # measured by the runner on the saved weights
    before, after = load_file(pruned / "model.safetensors"), load_file(out / "model.safetensors")
    assert torch.equal(after["model.norm.weight"], 2 * before["model.norm.weight"])
    assert torch.equal(after["model.layers.0.mlp.down_proj.weight"], before["model.layers.0.mlp.down_proj.weight"])
    assert (out / "data" / "responses.jsonl").is_file() and not (tmp_path / "scaled.work").exists()


def test_an_unknown_method_fails_with_the_close_matches(pruned, prompts_file, tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown method 'kdd'; did you mean: kd"):
        RecoverRecipe(method="kdd")
    code, _, err = run_cli(capsys, ["recover", "--model", str(pruned), "--prompts", str(prompts_file), "-o",
                                    str(tmp_path / "x"), "--method", "lorra", *FAST])
    assert_one_line_error(code, err, "unknown method 'lorra'", "did you mean: lora")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", METHODS.names())
def test_every_method_declares_its_teacher_its_section_and_a_memory_plan(name, tiny_llama):
    method = METHODS.get(name)
    assert method.name == name and isinstance(method.needs_teacher, bool) and callable(method.train)
    if method.section is not None:
        assert issubclass(RecoverRecipe.model_fields[method.section].annotation, Section)
    recipe = RecoverRecipe(method=name)
    config = AutoConfig.from_pretrained(tiny_llama)
    _, plan = plan_for(recipe, config, RecoverJob(output=Path("unused")), cuda=True, teacher=str(tiny_llama))
    assert isinstance(plan, MemoryPlan) and plan.total > 0 and plan.method in (name, recipe.chain_name())
    assert (plan.teacher > 0) == method.needs_teacher  # a teacher in memory is in the plan, and only then
