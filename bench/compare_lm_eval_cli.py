"""Same numbers as lm-eval's own CLI? `evaluate` vs `lm_eval --include_path` on the same local files and settings.

    .venv/bin/python bench/compare_lm_eval_cli.py [--limit 200] [--shots 0,5] [--tasks arc_easy,...] [--model embedded]

Two arms: zero-shot over the classification tasks, and 5-shot over arc_easy, arc_challenge and openbookqa (the
tasks whose few-shot pool, lm-eval's training split, is in the mirror); --tasks replaces both lists.
For each task: our `evaluate_model` (lm-eval's Python API inside layerprune) and lm-eval's CLI in a
subprocess, reading the same JSONL files through a task YAML that includes lm-eval's own file and swaps only the
data source. Prints every metric of both side by side; exits 1 when any differs. Also prints each side's seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from layerprune.core.settings import RunSettings
from layerprune.evaluate import EvalSettings, evaluate_model, plan_tasks
from layerprune.evaluate.offline import write_task_yaml
from layerprune.evaluate.task_specs import TASKS
from layerprune.models import resolve_model
from layerprune.tasks.data import resolve_data_dir

CLASSIFICATION = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa"]
FEWSHOT = ["arc_easy", "arc_challenge", "openbookqa"]


def lm_eval_cli(model_dir: str, task: str, data_dir: Path, folder: Path, limit: int, batch: int,
                fewshot: int | None, pool: str | None) -> dict[str, float]:
    """lm-eval's CLI on a task YAML that includes lm-eval's own and swaps only the files (scored split, pool)."""
    write_task_yaml(TASKS.get(task), data_dir, folder / "tasks", pool)
    command = [str(Path(sys.executable).parent / "lm_eval"), "--model", "hf", "--model_args",
               f"pretrained={model_dir},dtype=float32", "--tasks", task, "--include_path", str(folder / "tasks"),
               "--limit", str(limit), "--batch_size", str(batch), "--device", "cpu",
               "--output_path", str(folder / "out" / f"{task}-{fewshot}")]
    if fewshot is not None:
        command += ["--num_fewshot", str(fewshot)]
    subprocess.run(command, check=True, capture_output=True)
    (result,) = (folder / "out" / f"{task}-{fewshot}").rglob("results_*.json")
    scores = json.loads(result.read_text())["results"][task]
    return {key.split(",")[0]: value for key, value in scores.items() if "stderr" not in key and key != "alias"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--tasks", default=None, help="tasks of every arm (default: classification / 5-shot lists)")
    parser.add_argument("--shots", default="0,5", help="the arms: few-shot counts")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    data_dir = resolve_data_dir(args.data_dir)
    assert data_dir is not None, "no data mirror: pass --data-dir"
    run = RunSettings()
    source = resolve_model(args.model, run)
    differ = 0
    print(f"limit {args.limit}, model {args.model}")
    print(f"{'task':<14} {'shots':>5} {'pool':<6} {'metric':<9} {'layerprune':>10} {'lm_eval CLI':>11}  same   "
          "ours s  CLI s")
    with tempfile.TemporaryDirectory() as tmp:
        for shots in [int(n) for n in args.shots.split(",")]:
            tasks = args.tasks.split(",") if args.tasks else FEWSHOT if shots else CLASSIFICATION
            for task in tasks:
                differ += compare_task(source, task, shots, args, data_dir, Path(tmp), run)
    print(f"{differ} metric(s) differ" if differ else "all metrics identical")
    return 1 if differ else 0


def compare_task(source, task: str, shots: int, args: argparse.Namespace, data_dir: Path, tmp: Path,  # noqa: ANN001
                 run: RunSettings) -> int:
    """Print one task's metrics from both sides; the number that differ."""
    settings = EvalSettings(tasks=[task], limit=args.limit, batch_size=str(args.batch_size), num_fewshot=shots,
                            data_dir=data_dir, reuse=False)
    pool = plan_tasks(settings, data_dir)[0][0].fewshot_pool
    start = time.perf_counter()
    ours = {r.metric: r.value for r in evaluate_model(source, settings, run).results}
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = lm_eval_cli(source.location, task, data_dir, tmp, args.limit, args.batch_size, shots, pool)
    theirs_s = time.perf_counter() - start
    differ = 0
    for metric, value in ours.items():
        same = value == theirs.get(metric)
        differ += not same
        print(f"{task:<14} {shots:>5} {pool or '-':<6} {metric:<9} {value:>10.4f} "
              f"{theirs.get(metric, float('nan')):>11.4f}  {'yes' if same else 'NO':<5} {ours_s:7.1f} {theirs_s:6.1f}",
              flush=True)
    return differ


if __name__ == "__main__":
    raise SystemExit(main())
