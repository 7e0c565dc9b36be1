"""`layerprune records`: a run's per-item records packed without document text, unpacked into a tree that reads as
the run itself."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from layerprune.cli import main
from layerprune.core.errors import LayerpruneError
from layerprune.evaluate.items import read_items
from layerprune.pipeline.records import pack_records, unpack_records

SECRET = "The capital of Elbonia is Mudville"


def _sample(doc_id: int, correct: int) -> dict:
    doc = {"question": f"{SECRET}? ({doc_id})", "choices": ["a", "b", "c"], "answer": correct}
    return {"doc_id": doc_id, "doc": doc, "target": correct, "arguments": [[f"{SECRET} {doc_id}", c] for c in "abc"],
            "resps": [[[-1.0, False]], [[-2.0, False]], [[-3.0, False]]], "filtered_resps": [[-1.0, False]] * 3,
            "filter": "none", "metrics": ["acc", "bleu"], "doc_hash": f"d{doc_id}", "prompt_hash": f"p{doc_id}",
            "target_hash": f"t{doc_id}", "acc": float(correct == 0), "bleu": [SECRET, "a"],  # a corpus metric
            "lm_eval_extra": SECRET}


def _run(root: Path) -> Path:
    """A run as the stages leave it: an evaluation, a saved model, teacher answers, a report."""
    folder = root / "run" / "eval" / "baseline"
    (folder / "samples").mkdir(parents=True)
    (folder / "samples" / "arc.jsonl").write_text("".join(json.dumps(_sample(i, i % 2)) + "\n" for i in range(6)))
    (folder / "results").mkdir()
    (folder / "results" / "arc.json").write_text(json.dumps({"results": {"arc": {"acc,none": 0.5}},
                                                             "configs": {"arc": {"dataset": SECRET}}}))
    (folder / "summary.json").write_text(json.dumps({"zeta": 1, "arc": 0.5}))
    model = root / "run" / "pruned-k2"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "config.json").write_text("{}")
    (model / "prune_report.json").write_text(json.dumps({"removed": [3, 4], "target": {"target": "params=0.9x"},
                                                         "calibration": {"n": 2, "items": [
                                                             {"prompt": SECRET, "answer": "42"}, {"text": SECRET}]}}))
    (root / "run" / "tables").mkdir()
    (root / "run" / "tables" / "lm_eval.json").write_text(json.dumps({"results": {}, "configs": {"x": SECRET}}))
    (root / "run" / "selfgen.jsonl").write_text(json.dumps({"prompt": SECRET, "response": "x"}) + "\n")
    (root / "run" / "study.md").write_text("# a study\n")
    return root / "run"


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_pack_keeps_scores_and_reports_and_leaves_out_document_text_and_weights(tmp_path):
    run = _run(tmp_path)
    packed = pack_records(run, tmp_path / "rec.tar.gz")
    members = _members(packed.archive)
    assert sorted(members) == ["eval/baseline/results/arc.json", "eval/baseline/samples/arc.jsonl",
                               "eval/baseline/summary.json", "pruned-k2/prune_report.json", "records-manifest.json",
                               "study.md", "tables/lm_eval.json"]
    assert (packed.sample_files, packed.items, packed.other_files) == (1, 6, 5)
    assert not any(SECRET.encode() in data for data in members.values())
    first = json.loads(members["eval/baseline/samples/arc.jsonl"].splitlines()[0])
    assert first["n_arguments"] == 3 and first["acc"] == 1.0 and first["doc_hash"] == "d0"
    assert not {"doc", "arguments", "target", "bleu", "lm_eval_extra"} & set(first)
    assert json.loads(members["eval/baseline/results/arc.json"]) == {"results": {"arc": {"acc,none": 0.5}}}
    report = json.loads(members["pruned-k2/prune_report.json"])
    assert report["target"] == {"target": "params=0.9x"} and report["calibration"]["n"] == 2
    assert report["calibration"]["items"][1]["text"].startswith("sha256:")  # the same text, the same hash
    assert report["calibration"]["items"][0] == {"prompt": report["calibration"]["items"][1]["text"], "answer":
                                                 report["calibration"]["items"][0]["answer"]}


def test_unpacked_records_read_as_the_run_and_packing_is_reproducible(tmp_path):
    run = _run(tmp_path)
    archive = pack_records(run, tmp_path / "rec.tar.gz").archive
    unpack_records(archive, tmp_path / "back")
    for kind in ("classification", "generative"):
        original = read_items(run / "eval" / "baseline", "arc", "acc", kind)
        restored = read_items(tmp_path / "back" / "eval" / "baseline", "arc", "acc", kind)
        assert original.keys == restored.keys and original.checks == restored.checks
        assert np.array_equal(original.values, restored.values) and np.array_equal(original.chance, restored.chance)
    assert read_items(tmp_path / "back" / "eval" / "baseline", "arc", "acc", "classification").chance[0] == 1 / 3
    summary = (tmp_path / "back" / "eval" / "baseline" / "summary.json").read_text()
    assert list(json.loads(summary)) == ["zeta", "arc"]  # a report's own key order (a study's cells) is kept
    again = pack_records(run, tmp_path / "again.tar.gz").archive
    assert again.read_bytes() == archive.read_bytes()


def test_records_cli_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, capsys):
    run = _run(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["records", "pack", str(empty), "-o", str(tmp_path / "x.tar.gz")]) == 2
    assert main(["records", "pack", str(tmp_path / "nothing"), "-o", str(tmp_path / "x.tar.gz")]) == 2
    assert main(["records", "pack", str(run), "-o", str(run / "inside.tar.gz")]) == 2
    assert not (tmp_path / "x.tar.gz").exists() and not (run / "inside.tar.gz").exists()
    assert main(["records", "pack", str(run), "-o", str(tmp_path / "rec.tar.gz")]) == 0
    assert main(["records", "pack", str(run), "-o", str(tmp_path / "rec.tar.gz")]) == 2  # exists, no --overwrite
    (tmp_path / "bad.tar.gz").write_bytes(b"not gzip at all")
    assert main(["records", "unpack", str(tmp_path / "bad.tar.gz"), "-o", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(lines) == 5 and all("Traceback" not in line for line in lines)
    assert main(["records", "unpack", str(tmp_path / "rec.tar.gz"), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "eval" / "baseline" / "summary.json").is_file()


def test_a_report_over_the_size_limit_is_listed_not_packed(tmp_path, monkeypatch):
    from layerprune.pipeline import records

    run = _run(tmp_path)
    (run / "big.md").write_text("x" * 20_000)
    monkeypatch.setattr(records, "MAX_FILE", 10_000)
    packed = pack_records(run, tmp_path / "rec.tar.gz")
    assert packed.too_large == ("big.md",) and "big.md" not in _members(packed.archive)


def test_unpack_over_its_own_folder_is_refused_and_keeps_the_archive(tmp_path):
    run = _run(tmp_path)
    archive = pack_records(run, run.parent / "out" / "rec.tar.gz").archive
    with pytest.raises(LayerpruneError, match="is the input"):
        unpack_records(archive, run.parent / "out", overwrite=True)
    assert archive.is_file()


def test_unpack_refuses_links_in_an_archive(tmp_path):
    archive = tmp_path / "links.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("a.json")
        info.type, info.linkname = tarfile.SYMTYPE, "missing.json"
        tar.addfile(info)
    with pytest.raises(LayerpruneError, match="links or devices: a.json"):
        unpack_records(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unpack_refuses_a_member_outside_its_output(tmp_path):
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tar.addfile(info, __import__("io").BytesIO(b"hi"))
    with pytest.raises(LayerpruneError, match="not a records archive"):
        unpack_records(archive, tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "out").exists()


def test_a_malformed_sample_file_is_refused_in_one_line_naming_its_line(tmp_path):
    run = _run(tmp_path)
    (run / "eval" / "baseline" / "samples" / "arc.jsonl").write_text('{"doc_id": 0}\n{not json\n')
    with pytest.raises(LayerpruneError, match=r"arc.jsonl:2: not valid JSON"):
        pack_records(run, tmp_path / "rec.tar.gz")
    assert not (tmp_path / "rec.tar.gz").exists()


def test_an_importance_analysis_packs_its_per_item_scores_whatever_their_size_and_hashes_its_items(tmp_path,
                                                                                                   monkeypatch):
    """A variant study's evidence is importance.json (each item's score with every block skipped): packed whole even
    over MAX_FILE, its items counted, the items' prompts and answers hashed; a run with neither kind of record is
    refused."""
    from layerprune.pipeline import records

    run = tmp_path / "study"
    (run / "importance").mkdir(parents=True)
    result = {"drops": [0.5, 0.0], "critical": [0], "per_item": {
        "prompts": [f"{SECRET} {i}" for i in range(3)], "answers": ["1", "2", "3"],
        "base_item_nll": [0.1, 0.2, 0.3], "ablated_item_nll": [[1.0, 2.0, 3.0], [0.1, 0.2, 0.3]],
        "base_item_correct": [True, True, False]}}
    report = {"config": {"models": ["a", "b"]}, "tasks": {"t1": {"a": result, "b": result}, "t2": {"a": result}}}
    (run / "importance" / "importance.json").write_text(json.dumps(report))
    (run / "variant.md").write_text("# variant study\n")
    monkeypatch.setattr(records, "MAX_FILE", 12)  # the report over it, the records far over it
    packed = pack_records(run, tmp_path / "rec.tar.gz")
    assert packed.items == 9 and packed.too_large == ("variant.md",)
    kept = json.loads(_members(packed.archive)["importance/importance.json"])
    assert SECRET.encode() not in _members(packed.archive)["importance/importance.json"]
    assert kept["tasks"]["t1"]["a"]["per_item"]["ablated_item_nll"] == result["per_item"]["ablated_item_nll"]
    assert kept["tasks"]["t1"]["a"]["per_item"]["prompts"][0].startswith("sha256:")
    (run / "importance" / "importance.json").unlink()
    with pytest.raises(LayerpruneError, match="no per-item records"):
        pack_records(run, tmp_path / "other.tar.gz")
