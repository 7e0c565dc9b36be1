"""The evaluation summary (summary.json): one strict schema for the writer and every reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerprune.core.errors import LayerpruneError
from layerprune.core.provenance import collect_provenance
from layerprune.evaluate.summary import SUMMARY_FILE, Summary, TaskResult, read_summary, write_summary


def a_summary() -> Summary:
    rows = [TaskResult(task="gsm8k", kind="generative", metric="exact_match,strict-match", value=0.25, stderr=0.05,
                       n=40, headline=True, settings={"limit": 40, "chat_template": True}, seconds=3.5,
                       statuses=None),
            TaskResult(task="humaneval_plus", kind="generative", metric="pass@1", value=0.0, stderr=None, n=2,
                       headline=True, settings={}, seconds=1.0, cached=True, statuses={"passed": 0, "timeout": 2})]
    return Summary(model={"spec": "m", "location": "/m", "kind": "local", "identity": {"weights_sha256": "ab"},
                          "chat_template": "auto", "has_chat_template": True},
                   model_hash="f" * 64, results=rows, provenance=collect_provenance(), skipped={"mmlu": "no data"},
                   calibration_overlap={"calibration": "c.jsonl", "tasks": {}, "allowed": False})


def test_writer_and_reader_round_trip(tmp_path):
    summary = a_summary()
    path = write_summary(tmp_path, summary)
    assert path == tmp_path / SUMMARY_FILE
    assert read_summary(path) == summary
    assert [p.name for p in tmp_path.iterdir()] == [SUMMARY_FILE]  # the temporary file is gone


def rewrite(path: Path, change) -> None:
    body = json.loads(path.read_text())
    change(body)
    path.write_text(json.dumps(body))


@pytest.mark.parametrize("change, named", [
    (lambda b: b["results"][0].update(valeu=b["results"][0].pop("value")), "valeu"),
    (lambda b: b["model"].update(has_chat_templat=b["model"].pop("has_chat_template")), "has_chat_templat"),
    (lambda b: b.update(model_hsh=b.pop("model_hash")), "model_hsh"),
    (lambda b: b["results"][1].update(value="0.5"), "value"),  # a number written as text is not a number
])
def test_a_misspelled_key_is_refused_in_one_line(tmp_path, change, named):
    path = write_summary(tmp_path, a_summary())
    rewrite(path, change)
    with pytest.raises(LayerpruneError) as info:
        read_summary(path)
    message = str(info.value)
    assert named in message and str(path) in message and "\n" not in message


def test_garbled_or_missing_summary_is_a_one_line_error(tmp_path):
    (tmp_path / SUMMARY_FILE).write_text('{"model": {"spec"')
    for path in (tmp_path / SUMMARY_FILE, tmp_path / "none" / SUMMARY_FILE):
        with pytest.raises(LayerpruneError) as info:
            read_summary(path)
        assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_run_report_reads_summaries_through_the_schema(tmp_path):
    from layerprune.pipeline.report import load_summaries
    from layerprune.pipeline.stages import RunPaths

    paths = RunPaths(tmp_path)
    paths.eval("baseline").mkdir(parents=True)
    write_summary(paths.eval("baseline"), a_summary())
    assert set(load_summaries(paths)) == {"baseline"}
    rewrite(paths.eval("baseline") / SUMMARY_FILE, lambda b: b["results"][0].update(stder=0.1))
    with pytest.raises(LayerpruneError, match="stder"):
        load_summaries(paths)
