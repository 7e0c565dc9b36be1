"""recover resumes exactly: SIGKILL at a chosen moment and rerun gives the report of a run that never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer

from helpers import make_pruned_student
from layerprune.cli import main
from layerprune.pipeline import stages
from layerprune.recover import runner

ARGS = ["--max-new-tokens", "6", "--no-generate-drop-truncated", "--samples", "8", "--generate-batch-size", "4",
        "--train-max-length", "64", "--train-batch-size", "2", "--train-grad-accum", "1", "--max-steps", "3",
        "--held-out", "0.25", "--train-warmup-steps", "0", "--no-train-gradient-checkpointing", "--learning-rate",
        "1e-2", "--lora-r", "4", "--train-save-steps", "1", "--train-eval-steps", "2", "--train-logging-steps", "1",
        "--device", "cpu", "-q"]

# where the killed process dies (`point` runs inside the recover command, in a fresh interpreter)
KILLS = {
    "generation": """
        from layerprune.recover import selfgen
        append = selfgen._append
        def after_first_batch(path, rows):
            append(path, rows)
            os.kill(os.getpid(), signal.SIGKILL)
        selfgen._append = after_first_batch
    """,
    "after-checkpoint": """
        from transformers import Trainer
        save = Trainer._save_checkpoint
        def save_then_die(self, model, trial):
            save(self, model, trial)
            if self.state.global_step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        Trainer._save_checkpoint = save_then_die
    """,
    "inside-checkpoint": """
        from transformers import TrainerState
        def die_in_checkpoint_2(self, path):
            if "checkpoint-2" in str(path):
                os.kill(os.getpid(), signal.SIGKILL)
            return save(self, path)
        save = TrainerState.save_to_json
        TrainerState.save_to_json = die_in_checkpoint_2
    """,
    "before-output": """
        from layerprune.recover import runner
        runner.save_outputs = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    """,
}


@pytest.fixture(scope="module")
def pruned(tiny_models, tmp_path_factory) -> Path:
    return make_pruned_student(tiny_models("llama", 6), tmp_path_factory.mktemp("pruned") / "p2")


def command(pruned: Path, out: Path, *extra: str) -> list[str]:
    return ["recover", "--model", str(pruned), "--prompts", str(pruned.parent / "prompts.jsonl"), "-o", str(out),
            "--temperature", "0.9", *ARGS, *extra]


@pytest.fixture(scope="module")
def uninterrupted(pruned, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "rec"
    assert main(command(pruned, out)) == 0
    return out


def kill(pruned: Path, out: Path, point: str) -> None:
    script = "import os, signal, sys\n" + textwrap.dedent(KILLS[point]) + \
        "from layerprune.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, *command(pruned, out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert not out.exists()


def numbers(out: Path) -> dict:
    report = json.loads((out / "recover_report.json").read_text())
    data = {k: v for k, v in report["data"].items() if k not in ("generation", "resumed_from_step")}
    counted = {k: report[k] for k in ("tokens_unpadded", "tokens_padded", "sequences", "optimizer_steps")}
    return {"held_out_loss": report["held_out_loss"], "loss_curve": report["loss_curve"], "data": data, **counted,
            "tokens_seen": report["tokens_seen"], "responses": (out / "data" / "responses.jsonl").read_text()}


def check_same_as_uninterrupted(out: Path, uninterrupted: Path) -> None:
    assert numbers(out) == numbers(uninterrupted)
    saved, whole = load_file(out / "model.safetensors"), load_file(uninterrupted / "model.safetensors")
    for name in whole:
        torch.testing.assert_close(saved[name], whole[name], msg=name)


@pytest.mark.parametrize("point", ["after-checkpoint", pytest.param("generation", marks=pytest.mark.slow),
                                   pytest.param("inside-checkpoint", marks=pytest.mark.slow),
                                   pytest.param("before-output", marks=pytest.mark.slow)])
def test_sigkill_and_rerun_gives_the_uninterrupted_report(point, pruned, uninterrupted, tmp_path):
    out = tmp_path / "rec"
    kill(pruned, out, point)
    assert main(command(pruned, out, "--resume")) == 0
    check_same_as_uninterrupted(out, uninterrupted)
    report = json.loads((out / "recover_report.json").read_text())
    expected = {"generation": 0, "after-checkpoint": 2, "inside-checkpoint": 1, "before-output": 3}[point]
    assert report["data"]["resumed_from_step"] == expected
    if point == "generation":
        assert report["data"]["generation"]["resumed_from"] == 4


def test_resume_runs_only_the_remaining_steps(pruned, tmp_path, monkeypatch):
    out = tmp_path / "rec"
    kill(pruned, out, "after-checkpoint")
    steps = []
    step = Trainer.training_step
    monkeypatch.setattr(Trainer, "training_step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    assert main(command(pruned, out, "--resume")) == 0
    assert len(steps) == 1  # step 3 of 3; without --resume all three run again


def test_run_pipeline_resumes_recovery(monkeypatch, tmp_path):
    jobs = []
    monkeypatch.setattr(runner, "recover_model", lambda recipe, job: jobs.append(job))
    recipe = SimpleNamespace(recover=SimpleNamespace(resolve=lambda student, teacher: None), model="embedded",
                             evaluate=SimpleNamespace(data_dir=None), prune=SimpleNamespace(data_dir=None))
    stages.run_recover(recipe, stages.RunSettings(), stages.RunPaths(tmp_path))
    assert jobs and jobs[0].resume is True
