"""Result pages drawn from records archives (`layerprune records report|check`, `make results`).

Each archive in docs/records is unpacked and its study's report drawn again by the study's own report writer (the
sweep, grain and variant writers, `evaluate.report.compare`, `analyze sweeps`), under today's statistics. A page is
that report, headed by what a person wrote once per study in `questions.yaml` (the question, what the study shows and
cannot show, a one-line answer whose figures are placeholders filled from the redrawn report's JSON) and by what the
records say about how they were made (recipe fingerprint, commit, machine, dates). No figure is typed: a page can
be drawn again at any time and must come out the same (tests/test_results.py).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic

QUESTIONS = "questions.yaml"
INDEX = "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
PLACEHOLDER = re.compile(r"\{(pct|pts|num|raw):([^}]+)\}")
IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")
# charts a report draws (or keeps) without showing them in its Markdown: the page shows them
CHARTS = {"grain": ("grain.png",), "variant": ("importance/heatmap.png",), "comparisons": ("*/averages.png",)}


@dataclass(frozen=True)
class Redrawn:
    """One archive redrawn: its study name and kind, the unpacked tree, the report's Markdown, the report's data
    (redrawn and as archived, by file) and the run's recorded facts."""

    name: str
    kind: str
    root: Path
    markdown: str
    data: dict[str, Any]
    archived: dict[str, Any]


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _sweep(root: Path, out: Path) -> tuple[str, dict[str, Any]]:
    """A sweep's sweep.json and sweep.md (with budgets, budget.md and budget.json after them); the loss curves come
    from the archived sweep.json (the recover reports are scrubbed of their data text and do not read back)."""
    from layerprune.pipeline.studies import sweep_report
    from layerprune.pipeline.studies.sweep_grid import SweepStudy

    curves = {(int(k) if k.isdigit() else k): v for k, v in _load(root / "sweep.json")["curves"].items()}
    study = _study(SweepStudy, root)
    sweep_report.write_sweep_report(study, root, curves)
    text, data = (root / "sweep.md").read_text(), {"sweep.json": _load(root / "sweep.json")}
    if study.budgets:  # the budget curves after it, as the study's report stage draws them
        from layerprune.pipeline.studies.budget_report import write_budget_report

        write_budget_report(study, root)
        text += "\n" + re.sub(r"^(#+) ", r"#\1 ", (root / "budget.md").read_text(), flags=re.M)
        data["budget.json"] = _load(root / "budget.json")
    return text, data


def _study(kind: Any, root: Path) -> Any:
    """The study's recipe as run.json recorded it; the shipped recipe of that name where the record no longer
    validates."""
    run = _load(root / "run.json")
    try:
        return kind.model_validate(run["recipe"])
    except ValueError:
        return kind.load(run["name"], root)


def _grain(root: Path, out: Path) -> tuple[str, dict[str, Any]]:
    from layerprune.pipeline.studies.grain_report import write_grain_report
    from layerprune.pipeline.studies.sweep_grid import SweepStudy

    write_grain_report(_study(SweepStudy, root), root)  # an archive of the grain study's own kind: its shipped cell
    return (root / "grain.md").read_text(), {"grain.json": _load(root / "grain.json")}


def _variant(root: Path, out: Path) -> tuple[str, dict[str, Any]]:
    from layerprune.pipeline.studies.variant_report import redraw_variant_report

    redraw_variant_report(root)  # every seed's importance report, with several makes of the variant
    return (root / "variant.md").read_text(), {"variant.json": _load(root / "variant.json")}


def _comparisons(root: Path, out: Path) -> tuple[str, dict[str, Any]]:
    """Every */comparison.json compared again from its scored folders (`evaluate.report.compare`)."""
    from layerprune.evaluate import report
    from layerprune.evaluate.summary import SUMMARY_FILE, read_summary

    scored = {read_summary(p).model.identity.get("sha256"): p.parent for p in root.glob("*/*/" + SUMMARY_FILE)}
    text, data = ["# Comparisons", ""], {}
    for done in sorted(root.glob("*/comparison.json")):
        models = _load(done)["models"]
        folders = {role: scored[m["identity"]["sha256"]] for role, m in models.items()}
        target = out / done.parent.name
        report.compare({role: read_summary(f / SUMMARY_FILE) for role, f in folders.items()}, target, folders)
        shutil.copy(target / "comparison.json", done)
        for png in target.glob("*.png"):
            shutil.copy(png, done.parent / png.name)
        body = re.sub(r"^(#+) ", r"#\1 ", (target / "comparison.md").read_text(), flags=re.M)
        folder = done.parent.name
        text += [f"# {folder}", "", IMAGE.sub(lambda m, folder=folder: f"![{m[1]}]({folder}/{m[2]})", body)]
        data[f"{done.parent.name}/comparison.json"] = _load(done)
    return "\n".join(text), data


def _sweeps(root: Path, out: Path) -> tuple[str, dict[str, Any]]:
    """A sweep-shaped folder of records without a report of its own: its arms compared (`analyze sweeps`)."""
    from types import SimpleNamespace

    from layerprune.pipeline.studies.sweep_join import analyze_sweeps

    data = analyze_sweeps(SimpleNamespace(runs=[str(root)], own_models=False), None, out)
    return (out / "summary.md").read_text(), {"sweeps.json": json.loads(json.dumps(data))}


KINDS: dict[str, tuple[Callable[[Path], bool], Callable[[Path, Path], tuple[str, dict[str, Any]]]]] = {
    "grain": (lambda r: (r / "grain.json").is_file(), _grain),
    "variant": (lambda r: (r / "variant.json").is_file(), _variant),
    "sweep": (lambda r: (r / "sweep.md").is_file() and (r / "run.json").is_file(), _sweep),
    "sweeps": (lambda r: (r / "sweep.json").is_file() and (r / "run.json").is_file(), _sweeps),
    "comparisons": (lambda r: any(r.glob("*/comparison.json")), _comparisons),
}


def study_kind(root: Path) -> str:
    """Which report an unpacked archive holds (the first of KINDS whose files it has); refused where a report was
    drawn from a run in progress (`study --report`): its page would pass for the study's result."""
    for name in ("sweep.json", "budget.json", "grain.json"):
        if (root / name).is_file() and "partial" in _load(root / name):
            raise LayerpruneError(f"{root}: its {name} was drawn from a run in progress (study --report): archive "
                                  "the finished run")
    for kind, (holds, _) in KINDS.items():
        if holds(root):
            return kind
    raise LayerpruneError(f"{root}: no report this tool can redraw (grain.json, variant.json, sweep.json with run.json,"
                          " or */comparison.json)")


@contextmanager
def redrawn(archive: Path) -> Iterator[Redrawn]:
    """`archive` unpacked in a temporary folder and its report drawn again there (removed on exit)."""
    from layerprune.pipeline.records import unpack_records

    name = archive.name.removesuffix(".tar.gz")
    with tempfile.TemporaryDirectory(prefix="layerprune-results-") as tmp:
        root, out = Path(tmp) / name, Path(tmp) / "redrawn"
        unpack_records(archive, root)
        out.mkdir()
        kind = study_kind(root)
        archived = {p.relative_to(root).as_posix(): _load(p) for p in root.glob("*.json")}
        archived.update({p.relative_to(root).as_posix(): _load(p) for p in root.glob("*/comparison.json")})
        markdown, data = KINDS[kind][1](root, out)
        markdown = markdown.replace(str(out), f"runs/{name}-redrawn").replace(str(root), f"runs/{name}")
        yield Redrawn(name, kind, root, markdown, data, archived)


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Where an archived value is missing from or differs in the redrawn one (floats to 1e-9; new keys are free)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k, v in old.items() for d in (differences(v, new[k], f"{path}/{k}") if k in new
                                                    else [f"{path}/{k}: missing"])]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True)) for d in differences(a, b, f"{path}/{i}")]
    if isinstance(old, float) and isinstance(new, (int, float)) and not isinstance(new, bool) \
            and math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-12):
        return []
    return [] if old == new else [f"{path}: {old!r:.60} -> {new!r:.60}"]


def check_archive(archive: Path) -> tuple[list[str], list[str], list[str]]:
    """(what the archive says it was made with, the report files compared, where the archived ones and the ones
    redrawn now differ)."""
    from layerprune.pipeline.records import records_origin

    with redrawn(archive) as done:
        origin = records_origin(done.root)
        compared = [f for f in done.data if f in done.archived]
        found = [f"{f}{d}" for f in compared for d in differences(done.archived[f], done.data[f])]
    return origin, compared, found


def _node(data: Any, path: str) -> Any:
    """The value at a slash path: the report file's name (which may hold a slash), then dict keys, list indexes, or
    `[key=value,...]` for the first matching dict."""
    path = path.strip("/")
    file = max((k for k in data if path.startswith(k + "/")), key=len, default=None)
    if file is None:
        raise LayerpruneError(f"results: {path} names none of the report's files ({', '.join(data)})")
    data = data[file]
    for part in path.removeprefix(file + "/").split("/"):
        if part.startswith("[") and isinstance(data, list):
            wanted = dict(pair.split("=", 1) for pair in part.strip("[]").split(","))
            data = next((d for d in data if all(str(d.get(k)) == v for k, v in wanted.items())), None)
        elif isinstance(data, list) and part.isdigit():
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            raise LayerpruneError(f"results: no '{part}' on the path {path}")
    return data


def _signed(value: float) -> str:
    return f"{value:+.1f}" if value < 0 else f"{value:.1f}"


def fill(template: str, data: dict[str, Any]) -> str:
    """A template's {pct:PATH}, {pts:PATH}, {num:PATH~INTERVALPATH} and {raw:PATH} filled from the report data
    (PATH starts with the report's file name: sweep.json/points/...)."""
    def one(match: re.Match[str]) -> str:
        kind, path = match[1], match[2]
        value_path, _, interval_path = path.partition("~")
        node = _node(data, value_path)
        if kind == "raw" or isinstance(node, str):
            return str(node)
        if kind == "num":
            interval = _node(data, interval_path) if interval_path else None
            bounds = "" if not interval_path else " [n/a]" if not interval else \
                f" [{interval[0]:.2f}, {interval[1]:.2f}]"  # n/a: an agreement the bootstrap cannot bound
            return f"{node:.2f}{bounds}"
        value = node["value"] if "value" in node else node["diff"]  # a paired difference of evaluate.report
        return f"{_signed(100 * value)}{'%' if kind == 'pct' else ' points'} [{_signed(100 * node['low'])}, " \
               f"{_signed(100 * node['high'])}]"
    return PLACEHOLDER.sub(one, template)


def _duration(times: list[str]) -> str:
    from datetime import datetime

    seconds = (datetime.fromisoformat(times[-1]) - datetime.fromisoformat(times[0])).total_seconds()
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def _made(root: Path) -> list[str]:
    """How the records were made, from what they hold: fingerprint and commit, machine, first and last record."""
    from layerprune.pipeline.records import records_origin

    provenances = []
    for path in sorted(root.rglob("*.json")):
        data = _load(path) if path.stat().st_size < 2**20 else None
        prov = data.get("provenance") if isinstance(data, dict) else None
        if isinstance(prov, dict) and isinstance(prov.get("time"), str):
            provenances.append(prov)
    lines = records_origin(root)
    if not provenances:
        return [*lines, "machine and dates: not recorded in the archive"]
    times = sorted(p["time"] for p in provenances)
    last = max(provenances, key=lambda p: p["time"])
    torch = last.get("versions", {}).get("torch", "?")
    span = f"{times[0][:16].replace('T', ' ')} to {times[-1][:16].replace('T', ' ')} UTC, {_duration(times)}"
    return [*lines, f"machine: {last.get('host', '?')}, Python {last.get('python', '?')}, torch {torch}",
            f"records made from {span} ({len(times)} timed records; the span is the study's time, queue and all)"]


def draw_page(done: Redrawn, entry: dict[str, Any]) -> str:
    """One study's page: the question and its answer, how it was made, then its report redrawn."""
    link = entry.get("journal")
    head = [f"# {entry.get('title', done.name)}", "",
            f"<!-- drawn by `layerprune records report docs/records/{done.name}.tar.gz` (make results): do not edit "
            "-->", "", f"**Question.** {entry.get('question', '(not written in questions.yaml)')}", "",
            f"**Answer.** {fill(entry['answer'], done.data) if 'answer' in entry else '(not written)'}", "",
            f"**What it shows.** {entry.get('shows', '(not written)')}", "",
            f"**What it cannot show.** {entry.get('cannot', '(not written)')}", "", "## How it was made", "",
            f"- command: `{entry.get('command', 'see the report below')}`",
            *[f"- {line}" for line in _made(done.root)],
            f"- records: [docs/records/{done.name}.tar.gz](../records/{done.name}.tar.gz)",
            *([f"- the journal's account: [docs/benchmarks.md]({link})"] if link else []), "",
            *_chart_lines(done), "## The report, drawn again from the records", ""]
    body = re.sub(r"\A# [^\n]*\n", "", done.markdown.strip() + "\n")
    body = re.sub(r"^(#+) ", r"#\1 ", body, flags=re.M)
    body = IMAGE.sub(lambda m: f"![{m[1]}]({done.name}/{m[2]})", body)
    return "\n".join(head) + body


def _extra_charts(done: Redrawn) -> list[str]:
    shown = {m[2] for m in IMAGE.finditer(done.markdown)}
    return [p.relative_to(done.root).as_posix() for pattern in CHARTS.get(done.kind, ())
            for p in sorted(done.root.glob(pattern)) if p.relative_to(done.root).as_posix() not in shown
            and (done.kind != "comparisons" or (p.parent / "comparison.json").is_file())]


def _chart_lines(done: Redrawn) -> list[str]:
    extra = _extra_charts(done)
    return ["## Chart", "", *[f"![{c}]({done.name}/{c})" for c in extra], ""] if extra else []


def charts(done: Redrawn) -> dict[str, Path]:
    """The charts the page shows (page-relative path -> file in the redrawn tree)."""
    shown = [m[2] for m in IMAGE.finditer(done.markdown)] + _extra_charts(done)
    return {f"{done.name}/{c}": done.root / c for c in shown if (done.root / c).is_file()}


def read_questions(path: Path) -> dict[str, dict[str, Any]]:
    """questions.yaml: study name -> title, question, answer (a template), shows, cannot, command, journal, readme."""
    import yaml

    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise LayerpruneError(f"{path}: not YAML ({' '.join(str(exc).split())})") from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise LayerpruneError(f"{path}: expected a mapping of study name -> fields")
    return data


def index_rows(answers: dict[str, str], questions: dict[str, dict[str, Any]], readme: bool, base: str) -> list[str]:
    """The table of questions, their answers and their pages (the README's: the entries marked `readme`)."""
    rows = ["| question | answer (95% intervals) | page |", "|---|---|---|"]
    for name, answer in answers.items():
        entry = questions.get(name, {})
        if readme and not entry.get("readme"):
            continue
        rows.append(f"| {entry.get('readme') if readme else entry.get('question', name)} | {answer} | "
                    f"[{name}]({base}{name}.md) |")
    return rows


def draw_index(answers: dict[str, str], questions: dict[str, dict[str, Any]]) -> str:
    """docs/results/README.md: every study's question, its answer in one line and its page."""
    return "\n".join(["# Results", "", "<!-- drawn by `make results` from docs/records: do not edit -->", "",
                      "Each row is a question one study asks, its answer as the study's records give it today (drawn "
                      "again from the per-item records by `make results`), and the study's page: the recipe, the "
                      "command, the tables with their intervals, the chart, what it can and cannot show. Earlier and "
                      "superseded runs: [docs/history.md](../history.md); the dated journal of every measurement: "
                      "[docs/benchmarks.md](../benchmarks.md).", "",
                      *index_rows(answers, questions, False, ""), ""])


def readme_block(text: str, answers: dict[str, str], questions: dict[str, dict[str, Any]]) -> str:
    """`text` (the README) with the lines between BEGIN and END replaced by the README's table."""
    if BEGIN not in text or END not in text:
        raise LayerpruneError(f"the README has no {BEGIN} ... {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    table = "\n".join(index_rows(answers, questions, True, "docs/results/"))
    return f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}"


def draw_results(archives: list[Path], questions: dict[str, dict[str, Any]], charts_to: Path | None = None
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """(page file name -> text, study name -> one-line answer) for every archive; charts copied under `charts_to`."""
    pages, answers = {}, {}
    for archive in sorted(archives):
        with redrawn(archive) as done:
            entry = questions.get(done.name, {})
            pages[f"{done.name}.md"] = draw_page(done, entry)
            answers[done.name] = fill(entry["answer"], done.data) if "answer" in entry else "(not written)"
            for target, source in (charts(done) if charts_to is not None else {}).items():
                (charts_to / target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, charts_to / target)
    order = list(questions) + sorted(set(answers) - set(questions))
    return pages, {name: answers[name] for name in order if name in answers}


def write_results(archives: list[Path], output: Path, index: bool, readme: Path | None) -> list[Path]:
    """Every archive's page under `output`; with `index`, output/README.md; with `readme`, its results block. An
    archive that cannot be drawn leaves no `output` folder behind that was not there before."""
    made = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    try:
        questions = read_questions(output / QUESTIONS)
        pages, answers = draw_results(archives, questions, output)
    except BaseException:
        if made:
            shutil.rmtree(output, ignore_errors=True)
        raise
    written = []
    for name, text in pages.items():
        write_atomic(output / name, text.encode())
        written.append(output / name)
    if index:
        write_atomic(output / INDEX, draw_index(answers, questions).encode())
        written.append(output / INDEX)
    if readme is not None:
        write_atomic(readme, readme_block(readme.read_text(), answers, questions).encode())
        written.append(readme)
    return written
