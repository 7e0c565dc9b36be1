"""The one stage loop (pipeline/runner.py): order, resume, dry run, errors, the report's refresh."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerprune.pipeline.runner import Stage, run_stages


def writer(calls: list[str], name: str, output: Path, fail: bool = False) -> Stage:
    """A stage that records its call and writes its output last (as every stage does), or raises before it."""

    def action() -> None:
        calls.append(name)
        if fail:
            raise RuntimeError(f"{name} broke")
        output.write_text(name)

    return Stage(name, output, action)


def test_stages_run_in_order_and_a_rerun_resumes_at_the_first_incomplete_one(tmp_path, caplog):
    calls: list[str] = []
    broken = [writer(calls, "a", tmp_path / "a"), writer(calls, "b", tmp_path / "b"),
              writer(calls, "c", tmp_path / "c", fail=True), writer(calls, "d", tmp_path / "d")]
    with pytest.raises(RuntimeError, match="c broke") as caught:
        run_stages(broken, tmp_path)
    assert calls == ["a", "b", "c"]
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()  # no completion marker of the failure
    assert caught.value.layerprune_stage == "c" and caught.value.layerprune_folder == tmp_path

    calls.clear()
    fixed = [writer(calls, s.name, s.output) for s in broken]
    with caplog.at_level("INFO"):
        assert run_stages(fixed, tmp_path) == ["c", "d"]
    assert calls == ["c", "d"]
    assert "[1/4] a: complete, skipped" in caplog.text and "[2/4] b: complete, skipped" in caplog.text
    assert "[3/4] c ..." in caplog.text and "[4/4] d done in" in caplog.text

    calls.clear()
    assert run_stages(fixed, tmp_path) == [] and calls == []


def test_dry_run_runs_no_action_and_names_what_would_run(tmp_path, caplog):
    calls: list[str] = []
    (tmp_path / "a").write_text("done")
    stages = [writer(calls, "a", tmp_path / "a"), writer(calls, "b", tmp_path / "b")]
    with caplog.at_level("INFO"):
        assert run_stages(stages, tmp_path, dry_run=True) == ["b"]
    assert calls == [] and not (tmp_path / "b").exists()
    assert "[1/2] a: complete, skipped" in caplog.text and "[2/2] b: would run" in caplog.text


def test_a_refresh_stage_reruns_after_work_and_a_stage_without_output_always_runs(tmp_path):
    calls: list[str] = []
    report = Stage("report", tmp_path / "report", lambda: calls.append("report"), refresh=True)
    (tmp_path / "report").write_text("old")
    (tmp_path / "a").write_text("done")
    assert run_stages([writer(calls, "a", tmp_path / "a"), report]) == [] and calls == []
    (tmp_path / "a").unlink()
    assert run_stages([writer(calls, "a", tmp_path / "a"), report]) == ["a", "report"]
    calls.clear()
    always = Stage("always", None, lambda: calls.append("always"))
    assert run_stages([always, always]) == ["always", "always"] and calls == ["always", "always"]


def test_a_complete_stage_removes_the_work_folder_an_interrupted_run_left(tmp_path, caplog):
    """A recovery writes its output, then removes its work folder: a run stopped between the two leaves the folder,
    which the next run removes when it finds the stage complete (and a dry run leaves alone)."""
    from layerprune.recover.job import leftover_of as recover_leftover

    output = tmp_path / "arms" / "sft@r2" / "recover_report.json"
    output.parent.mkdir(parents=True)
    output.write_text("{}")
    work = recover_leftover(output)
    assert work == tmp_path / "arms" / "sft@r2.work"
    (work / "final").mkdir(parents=True)
    stage = Stage("recover-sft@r2", output, lambda: pytest.fail("a complete stage ran"), leftover=work)
    assert run_stages([stage], tmp_path, dry_run=True) == [] and work.is_dir()
    with caplog.at_level("INFO"):
        assert run_stages([stage], tmp_path) == []
    assert not work.exists() and output.is_file() and "removed" in caplog.text
    assert recover_leftover(tmp_path / "eval" / "sft" / "summary.json") is None


def test_every_attempt_at_a_stage_adds_its_time_and_a_stage_counts_once_it_ends_done(tmp_path, monkeypatch):
    """With `times`, each attempt (failed, interrupted or done) is kept; stage_seconds sums them for the stages that
    ended done, so a stage resumed over three parts counts all three. (New: the times were only logged.)"""
    import json

    from layerprune.pipeline import runner
    from layerprune.pipeline.runner import stage_seconds

    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 27.0, 30.0, 31.0, 40.0, 41.0, 50.0, 52.0])
    monkeypatch.setattr(runner.time, "perf_counter", lambda: next(clock))
    calls: list[str] = []
    times = tmp_path / runner.TIMES
    with pytest.raises(RuntimeError):
        run_stages([writer(calls, "a", tmp_path / "a"), writer(calls, "b", tmp_path / "b", fail=True)], tmp_path,
                   times=times)

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_stages([writer(calls, "a", tmp_path / "a"), Stage("b", tmp_path / "b", interrupted)], tmp_path,
                   times=times)
    run_stages([writer(calls, "a", tmp_path / "a"), writer(calls, "b", tmp_path / "b")], tmp_path, times=times)
    attempts = json.loads(times.read_text())["attempts"]
    assert [(a["stage"], a["seconds"], a["done"]) for a in attempts] == [
        ("a", 5.0, True), ("b", 2.0, False), ("b", 7.0, False), ("b", 1.0, True)]
    assert stage_seconds(tmp_path) == {"a": 5.0, "b": 10.0}
    times.write_text("{not json")
    assert stage_seconds(tmp_path) == {}
    run_stages([writer(calls, "c", tmp_path / "c")], tmp_path, times=times)  # an unreadable file is started again
    assert stage_seconds(tmp_path) == {"c": 1.0}
    times.write_text(json.dumps({"attempts": [{"stage": "m", "seconds": 4.0, "done": False},
                                              {"stage": "m", "seconds": 6.0, "done": True},
                                              {"stage": "m", "seconds": 3.0, "done": True},
                                              {"stage": "m", "seconds": 9.0, "done": False}]}))
    assert stage_seconds(tmp_path) == {"m": 3.0}  # made again (its output removed): its last making only
    times.write_text(json.dumps({"attempts": None}))

    def stopped() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the interrupt, not the timing's trouble with the file
        run_stages([Stage("d", tmp_path / "d", stopped)], tmp_path, times=times)
    assert json.loads(times.read_text())["attempts"][0]["stage"] == "d"
