"""HumanEval+ scored as EvalPlus scores it: a pass means every check ran, the reference runs outside the candidate's
budget, each run's sandbox status is kept, pass@k and maj@N from sampled completions."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from helpers import evaluate_cli, write_rows
from layerprune.evaluate import Summary
from layerprune.evaluate.project_tasks import humaneval_config
from layerprune.evaluate.sandbox import SandboxLimits
from layerprune.evaluate.task_specs import TASKS

ADD = {"task_id": "Toy/0", "prompt": "def add(a, b):\n", "entry_point": "add", "test": "",
       "canonical_solution": "    return a + b\n", "atol": 0, "base_input": [[1, 2], [3, 4]],
       "plus_input": [[10, -3], [0.5, 0.25]]}
# the reference takes 0.8 s per input: more than the whole budget the old harness gave candidate AND reference
SLOW = {"task_id": "Toy/1", "prompt": "def twice(x):\n", "entry_point": "twice", "test": "", "atol": 0,
        "canonical_solution": "    import time\n    time.sleep(0.8)\n    return 2 * x\n",
        "base_input": [[1], [2]], "plus_input": []}
EARLY_EXITS = ["    import sys\n    sys.exit(0)\n", "    import os\n    os._exit(0)\n", "    exit()\n",
               "    return a + b\nimport os\nos._exit(0)\n", "    return a + b\nraise SystemExit(0)\n"]


def write_problems(root: Path, rows: list[dict]) -> Path:
    write_rows(root, "humaneval_plus", "test", rows)
    return root


def scorer(tmp_path: Path, rows: list[dict], timeout: float = 5.0):
    config = humaneval_config(TASKS.get("humaneval_plus"), write_problems(tmp_path / "data", rows),
                              SandboxLimits(timeout_s=timeout, memory_mb=512), tmp_path / "oracles")
    docs = {d["task_id"]: d for d in config["custom_dataset"]()["test"]}
    return lambda task_id, completion: config["process_results"](docs[task_id], [completion])


def test_early_exit_is_not_a_pass(tmp_path):
    score = scorer(tmp_path, [ADD])
    assert score("Toy/0", "    return a + b\n")["pass@1"] == 1.0
    for completion in EARLY_EXITS:
        result = score("Toy/0", completion)
        assert result["pass@1"] == 0.0, completion
        assert result["status"] == "failed", result


def test_wrong_answer_fails_and_floats_use_evalplus_tolerance(tmp_path):
    score = scorer(tmp_path, [ADD])
    assert score("Toy/0", "    return a - b\n")["status"] == "failed"
    off = "    return a + b + ({} if isinstance(a, float) else 0)\n"
    assert score("Toy/0", off.format(1e-9))["pass@1"] == 1.0  # within atol 1e-6 where the expected is a float
    assert score("Toy/0", off.format(1e-3))["pass@1"] == 0.0
    assert score("Toy/0", "    return a + b + 1e-9\n")["pass@1"] == 0.0  # a float where an int is expected


def test_reference_runs_outside_the_candidates_budget(tmp_path):
    score = scorer(tmp_path, [SLOW], timeout=1.0)
    assert score("Toy/1", "    return 2 * x\n")["pass@1"] == 1.0


def test_timeout_and_memory_are_their_own_status(tmp_path):
    score = scorer(tmp_path, [ADD])
    assert score("Toy/0", "    while True:\n        pass\n")["status"] == "timeout"
    assert score("Toy/0", "    x = bytearray(8 << 30)\n")["status"] == "memory"
    assert score("Toy/0", "    open('/etc/layerprune-check', 'w')\n")["status"] == "blocked"


def test_expected_outputs_are_cached_by_content(tmp_path, monkeypatch):
    from layerprune.evaluate import humaneval

    scorer(tmp_path, [ADD])
    monkeypatch.setattr(humaneval, "run_references", lambda rows: pytest.fail("recomputed a cached oracle"))
    scorer(tmp_path, [ADD])
    changed = {**ADD, "plus_input": [[7, 8]]}
    with pytest.raises(pytest.fail.Exception):
        scorer(tmp_path, [changed])


def test_references_run_in_one_process_and_a_failure_names_its_problem(monkeypatch):
    from layerprune.core.errors import LayerpruneError
    from layerprune.evaluate import humaneval

    pid = {**ADD, "task_id": "Toy/5", "canonical_solution": "    import os\n    return os.getpid()\n"}
    oracles = humaneval.run_references([ADD, pid, {**pid, "task_id": "Toy/6"}])
    assert oracles["Toy/0"].outputs == [3, 7, 7, 0.75] and len(oracles["Toy/0"].seconds) == 4
    assert len({*oracles["Toy/5"].outputs, *oracles["Toy/6"].outputs}) == 1  # one interpreter for the dataset
    broken = [{**ADD, "task_id": f"Toy/{i}", "canonical_solution": body} for i, body in
              enumerate(["    return a + b\n", "    return a + c\n", "    import os\n    os._exit(0)\n"])]
    with pytest.raises(LayerpruneError, match=r"of Toy/1 failed: NameError: name 'c' is not defined"):
        humaneval.run_references(broken)
    with pytest.raises(LayerpruneError, match=r"of Toy/2 failed: the oracle run ended early \(exit 0\)"):
        humaneval.run_references([broken[0], broken[2]])
    monkeypatch.setattr(humaneval, "REFERENCE_TIMEOUT", 0.3)
    with pytest.raises(LayerpruneError, match=r"of Toy/1 ran over 0.3s"):
        humaneval.run_references([SLOW])


def test_a_reference_stuck_in_c_code_is_stopped_and_named(monkeypatch, tmp_path):
    from layerprune.core.errors import LayerpruneError
    from layerprune.evaluate import humaneval

    # pbkdf2 runs in C for ~2 s of CPU: SIGALRM would wait for it to return, the watchdog (0.3 s) does not
    stuck = {**SLOW, "task_id": "Toy/7", "base_input": [[1]], "canonical_solution":
             "    import hashlib\n    hashlib.pbkdf2_hmac('sha256', b'x', b'y', 10_000_000)\n    return 2 * x\n"}
    # (the place is named when the watchdog catches the reference in its own code, as it almost always does)
    monkeypatch.setattr(humaneval, "REFERENCE_TIMEOUT", 0.3)
    with pytest.raises(LayerpruneError, match=r"of Toy/7 ran over 0.3s(, at reference.py line \d in twice)?$"):
        humaneval.run_references([ADD, stuck, SLOW])
    # where the watchdog fails too (here switched off), the parent kills the run: no new problem announced in time
    pid_file = tmp_path / "pid"
    silenced = {**SLOW, "task_id": "Toy/8", "canonical_solution":
                f"    import faulthandler, os, pathlib, time\n    faulthandler.cancel_dump_traceback_later()\n"
                f"    pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n    time.sleep(60)\n"}
    monkeypatch.setattr(humaneval, "REFERENCE_MARGIN", 1.0)
    with pytest.raises(LayerpruneError, match=r"of Toy/8 ran over 0.3s$"):
        humaneval.run_references([ADD, silenced])
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_a_slow_interpreter_start_is_not_counted_against_the_first_problem(monkeypatch, tmp_path):
    from layerprune.core.errors import LayerpruneError
    from layerprune.evaluate import humaneval

    slow_start = tmp_path / "python"
    slow_start.write_text(f"#!{sys.executable}\nimport os, sys, time\ntime.sleep(1)\n"  # one process, so a kill ends it
                          f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n")
    slow_start.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow_start))
    monkeypatch.setattr(humaneval, "REFERENCE_TIMEOUT", 0.3)
    with pytest.raises(LayerpruneError, match=r"of Toy/1 ran over 0.3s"):
        humaneval.run_references([SLOW])
    monkeypatch.setattr(humaneval, "REFERENCE_STARTUP", 0.2)
    with pytest.raises(LayerpruneError, match=r"announced no problem within 0.2s"):
        humaneval.run_references([ADD])


def test_large_outputs_compare_by_digest(tmp_path):
    big = {"task_id": "Toy/2", "prompt": "def seq(n):\n", "entry_point": "seq", "test": "", "atol": 0,
           "canonical_solution": "    return ' '.join(str(i) for i in range(n))\n", "base_input": [[200000]],
           "plus_input": [[3]]}
    power = {"task_id": "Toy/3", "prompt": "def power(n):\n", "entry_point": "power", "test": "", "atol": 0,
             "canonical_solution": "    return 7 ** n\n", "base_input": [[300000]], "plus_input": []}
    score = scorer(tmp_path, [big, power])
    assert score("Toy/2", "    return ' '.join(map(str, range(n)))\n")["pass@1"] == 1.0
    assert score("Toy/2", "    return ' '.join(map(str, range(n - 1)))\n")["pass@1"] == 0.0
    assert score("Toy/3", "    return pow(7, n)\n")["pass@1"] == 1.0  # beyond int-to-str's digit limit
    assert score("Toy/3", "    return 7 ** n + 1\n")["pass@1"] == 0.0


def test_pass_at_k_is_the_unbiased_estimator():
    from layerprune.evaluate.humaneval import pass_at_k
    from layerprune.evaluate.project_tasks import sampled_scores

    for n, c, k in [(20, 2, 10), (10, 3, 1), (5, 0, 1), (10, 10, 10), (30, 7, 10)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    scores = sampled_scores(["1", "2", "2", "3", "9", "9", "9", "9", "9", "2"], "2", majority=True)
    assert scores["pass@1"] == pytest.approx(0.3) and scores["pass@10"] == 1.0 and scores["maj@10"] == 0.0


def test_reference_solutions_and_statuses_in_samples(capsys, tmp_path, shared_data):
    rows = [json.loads(line) for line in (shared_data / "humaneval_plus" / "test.jsonl").open()][:2]
    huge = {"task_id": "Toy/4", "prompt": "def power(n):\n", "entry_point": "power", "test": "", "atol": 0,
            "canonical_solution": "    return 7 ** n\n", "base_input": [[6000]], "plus_input": []}  # > 4300 digits
    data = write_problems(tmp_path / "data", [*rows, huge])
    code, out, err = evaluate_cli(capsys, "--tasks", "humaneval_plus", "--reference-solutions", "--data-dir", str(data),
                                  "--output", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"))
    assert code == 0, err
    summary = Summary.model_validate_json((tmp_path / "o" / "summary.json").read_text())
    (row,) = summary.results
    assert row.value == 1.0 and row.n == 3 and row.statuses == {"passed": 3}
    samples = [json.loads(line) for line in (tmp_path / "o" / "samples" / "humaneval_plus.jsonl").open()]
    assert [s["status"] for s in samples] == ["passed"] * 3
    assert "passed 3" in out

    code, _, err = evaluate_cli(capsys, "--tasks", "humaneval_plus,arith_1dc", "--reference-solutions",
                                "--data-dir", str(data), "--output", str(tmp_path / "o2"))
    assert code == 2 and "error: --reference-solutions scores HumanEval+ only" in err
    assert not (tmp_path / "o2").exists()
    code, _, err = evaluate_cli(capsys, "--tasks", "humaneval_plus", "--reference-solutions", "--model", "embedded",
                                "--data-dir", str(data), "--output", str(tmp_path / "o3"))
    assert code == 2 and "drop --model" in err and not (tmp_path / "o3").exists()


def test_sampled_humaneval_scores_pass_at_k_and_keeps_every_status(tmp_path):
    from layerprune.evaluate.project_tasks import Sampling, with_sampling

    config = humaneval_config(TASKS.get("humaneval_plus"), write_problems(tmp_path / "data", [ADD]),
                              SandboxLimits(timeout_s=5, memory_mb=512), tmp_path / "oracles")
    sampled = with_sampling(config, Sampling(10, 0.8), majority=False)
    assert sampled["repeats"] == 10 and sampled["generation_kwargs"]["do_sample"] is True
    assert [m["metric"] for m in sampled["metric_list"]] == ["pass@1", "pass@10", "status", "check"]
    doc = config["custom_dataset"]()["test"][0]
    completions = ["    return a + b\n"] * 3 + ["    return a - b\n"] * 6 + ["    import os\n    os._exit(0)\n"]
    scores = config["process_results"](doc, [completions])
    assert scores["pass@1"] == pytest.approx(0.3) and scores["pass@10"] == 1.0
    assert scores["status"] == ["passed"] * 3 + ["failed"] * 7


def test_samples_per_task_reports_greedy_and_pass_at_k(capsys, tmp_path, tiny_llama):
    data = tmp_path / "data"
    gsm = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(3)]
    for split in ("train", "test"):
        write_rows(data, "gsm8k", split, gsm)
    code, out, err = evaluate_cli(capsys, "--model", str(tiny_llama), "--tasks", "arith_1dc,gsm8k", "--limit", "1",
                                  "--max-gen-toks", "3", "--num-fewshot", "1", "--samples-per-task", "10",
                                  "--temperature", "0.7", "--data-dir", str(data), "--output", str(tmp_path / "o"),
                                  "--cache-dir", str(tmp_path / "c"))
    assert code == 0, err
    summary = Summary.model_validate_json((tmp_path / "o" / "summary.json").read_text())
    metrics = {(r.task, r.metric): r for r in summary.results}
    assert metrics[("arith_1dc", "exact_match")].headline
    for task, names in [("arith_1dc", ["pass@1", "pass@10", "maj@10"]),
                        ("gsm8k", ["pass@1,strict-match", "pass@10,strict-match", "maj@10,flexible-extract"])]:
        for name in names:
            row = metrics[(task, f"{name} sampled")]
            assert not row.headline and row.settings["sampling"] == [10, 0.7] and 0.0 <= row.value <= 1.0
    sampled = [json.loads(line) for line in (tmp_path / "o" / "samples" / "arith_1dc.sampled.jsonl").open()]
    assert len(sampled) == 1 and len(sampled[0]["resps"][0]) == 10


def test_comparison_shows_greedy_and_sampled_scores():
    from layerprune.evaluate import TaskResult, compare

    def summary(greedy: float, sampled: float) -> Summary:
        common = {"task": "humaneval_plus", "kind": "generative", "stderr": None, "n": 164, "settings": {},
                  "seconds": 1.0}
        return Summary(model={"spec": "x", "location": "x", "kind": "local"}, model_hash="x", results=[
            TaskResult(metric="pass@1", value=greedy, headline=True, **common),
            TaskResult(metric="pass@10 sampled", value=sampled, headline=False, **common)])

    report = compare({"baseline": summary(0.30, 0.60), "pruned": summary(0.05, 0.50)})
    line = next(row for row in report["table"].splitlines() if "pass@10 sampled" in row)
    assert "0.6000" in line and "0.5000" in line
    assert report["averages"][0]["baseline"] == pytest.approx(0.30)  # averages stay over the greedy headlines
