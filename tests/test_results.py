"""docs/results: every page, the index and the README's "What we found" table are drawn from the records in
docs/records (`layerprune records report`, `make results`); drawn again, they must come out the same, so a page can
never disagree with its records. `records check` says whether an archive still redraws equal."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from layerprune.cli import main
from layerprune.core.errors import LayerpruneError
from layerprune.pipeline import results
from layerprune.pipeline.records import MANIFEST, pack_records, records_origin, unpack_records

ROOT = Path(__file__).resolve().parents[1]
RECORDS, PAGES = ROOT / "docs" / "records", ROOT / "docs" / "results"
ARCHIVES = sorted(RECORDS.glob("*.tar.gz"))
SMALL = ["grain-speed-math-embedded", "limits-sweep-math-gsm8k-embedded"]  # about a second each to redraw
MAX_RECORDS_BYTES = 50 * 10**6


def _questions() -> dict:
    return results.read_questions(PAGES / results.QUESTIONS)


def _differing(drawn: dict[str, str]) -> list[str]:
    return [name for name, text in drawn.items() if not (PAGES / name).is_file() or (PAGES / name).read_text() != text]


def test_records_stay_small_and_every_archive_has_a_question_and_a_page():
    assert sum(p.stat().st_size for p in RECORDS.rglob("*") if p.is_file()) < MAX_RECORDS_BYTES
    names = {p.name.removesuffix(".tar.gz") for p in ARCHIVES}
    assert names == set(_questions()), "docs/results/questions.yaml and docs/records/ name different studies"
    assert names == {p.stem for p in PAGES.glob("*.md")} - {"README"}
    assert all({"question", "answer", "shows", "cannot", "command"} <= set(e) for e in _questions().values())


@pytest.mark.parametrize("name", SMALL)
def test_a_small_archive_redraws_its_page_unchanged(name):
    pages, answers = results.draw_results([RECORDS / f"{name}.tar.gz"], _questions())
    assert not _differing(pages), f"docs/results/{name}.md differs from its records: run `make results`"
    assert answers[name] in (PAGES / results.INDEX).read_text()


@pytest.mark.slow
def test_every_page_the_index_and_the_readme_table_redraw_unchanged():
    questions = _questions()
    pages, answers = results.draw_results(ARCHIVES, questions)
    assert not _differing(pages), "pages differ from their records: run `make results`"
    assert (PAGES / results.INDEX).read_text() == results.draw_index(answers, questions)
    readme = (ROOT / "README.md").read_text()
    assert results.readme_block(readme, answers, questions) == readme, "README's table differs: run `make results`"


def test_the_readme_keeps_its_first_screen_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    first = "\n".join(readme.splitlines()[:45])
    for command in ("prune --drop 8 --score ablation", "recover --recipe selfgen-gsm8k", "evaluate --suite reasoning",
                    "layerprune run", "make demo", "make test"):
        assert command in first, command
    table = readme.split(results.BEGIN)[1].split(results.END)[0]
    assert 6 <= table.count("\n| ") - 1 <= 10  # rows, less the header's rule


DATA = {"sweep.json": {"points": [{"k": 2, "arm": "a", "share": {"value": 0.487, "low": 0.25, "high": -0.01}},
                                  {"k": 2, "arm": "b", "share": "n/a (no clear drop)"}],
                       "verdict": "shown", "ratio": 0.734, "interval": [0.712, 0.801]},
        "run-f16/comparison.json": {"rows": [{"task": "copy", "d": {"diff": -0.057, "low": -0.11, "high": 0.0}}]}}


def test_fill_formats_intervals_from_the_report_data():
    assert results.fill("kd {pct:sweep.json/points/[k=2,arm=a]/share} ({raw:sweep.json/verdict})", DATA) \
        == "kd 48.7% [25.0, -1.0] (shown)"
    assert results.fill("{pct:sweep.json/points/1/share}", DATA) == "n/a (no clear drop)"
    assert results.fill("{num:sweep.json/ratio~sweep.json/interval}", DATA) == "0.73 [0.71, 0.80]"
    assert results.fill("{pts:run-f16/comparison.json/rows/[task=copy]/d}", DATA) == "-5.7 points [-11.0, 0.0]"
    with pytest.raises(LayerpruneError, match="no 'missing'"):
        results.fill("{pct:sweep.json/missing}", DATA)
    with pytest.raises(LayerpruneError, match="names none"):
        results.fill("{pct:grain.json/x}", DATA)


def test_readme_block_is_replaced_between_the_markers_only():
    questions = {"s": {"readme": "Q?"}, "t": {"question": "not in the README"}}
    text = f"top\n{results.BEGIN}\nold\n{results.END}\nbottom\n"
    drawn = results.readme_block(text, {"s": "1.0% [0.0, 2.0]", "t": "x"}, questions)
    assert drawn.startswith("top\n") and drawn.endswith(f"{results.END}\nbottom\n") and "old" not in drawn
    assert "| Q? | 1.0% [0.0, 2.0] | [s](docs/results/s.md) |" in drawn and "not in the README" not in drawn
    with pytest.raises(LayerpruneError, match="no <!-- results:begin"):
        results.readme_block("no markers\n", {}, questions)


def test_pack_writes_a_manifest_and_an_old_archive_says_no_commit(tmp_path):
    run = tmp_path / "run"
    (run / "eval" / "m" / "samples").mkdir(parents=True)
    (run / "eval" / "m" / "samples" / "t.jsonl").write_text(json.dumps({"doc_id": 0, "acc": 1.0}) + "\n")
    (run / "run.json").write_text(json.dumps({"name": "s", "fingerprint": "abc", "recipe": {},
                                              "provenance": {"git": {"commit": "0123456789abcdef"}}}))
    archive = pack_records(run, tmp_path / "rec.tar.gz").archive
    unpack_records(archive, tmp_path / "back")
    manifest = json.loads((tmp_path / "back" / MANIFEST).read_text())
    assert manifest["run"] == {"name": "s", "fingerprint": "abc", "commit": "0123456789abcdef"}
    assert "commit" in manifest["packed_by"] and manifest["packed_by"]["layerprune"]
    origin = records_origin(tmp_path / "back")
    assert origin[0].startswith("packed by layerprune") and "fingerprint abc, run at commit 0123456789ab" in origin[1]
    again = pack_records(tmp_path / "back", tmp_path / "again.tar.gz").archive  # an unpacked tree packs one manifest
    with tarfile.open(again) as tar:
        assert [m.name for m in tar.getmembers()].count(MANIFEST) == 1
    (tmp_path / "back" / MANIFEST).unlink()
    assert records_origin(tmp_path / "back")[0].startswith("no commit recorded")


def test_check_finds_a_report_that_no_longer_matches_its_records(tmp_path, capsys):
    name = "grain-speed-math-embedded"
    unpack_records(RECORDS / f"{name}.tar.gz", tmp_path / name)
    grain = json.loads((tmp_path / name / "grain.json").read_text())
    grain["baseline"]["value"] += 0.125  # a figure typed over the one its records give
    (tmp_path / name / "grain.json").write_text(json.dumps(grain))
    tampered = pack_records(tmp_path / name, tmp_path / "out" / f"{name}.tar.gz").archive
    origin, compared, found = results.check_archive(tampered)
    assert compared == ["grain.json"] and origin[0].startswith("packed by layerprune")
    assert any(line.startswith("grain.json/baseline/value:") for line in found)
    assert main(["records", "check", str(tampered)]) == 1
    assert "differ when redrawn on the current code" in capsys.readouterr().out


def test_report_refuses_an_archive_it_cannot_redraw(tmp_path):
    (tmp_path / "run" / "eval" / "m" / "samples").mkdir(parents=True)
    (tmp_path / "run" / "eval" / "m" / "samples" / "t.jsonl").write_text(json.dumps({"doc_id": 0}) + "\n")
    archive = pack_records(tmp_path / "run", tmp_path / "rec.tar.gz").archive
    with pytest.raises(LayerpruneError, match="no report this tool can redraw"):
        results.draw_results([archive], {})
