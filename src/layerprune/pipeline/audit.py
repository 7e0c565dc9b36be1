"""Held out, measured: the recovery data (prompts and the teacher's answers) against every scored task's items.

A task is held out when its evaluated items do not appear in what the recovery trained on, not when no recovery
prompt was drawn from its name. Each item is examined by one of two checks, both on normalized text
(`tasks.contamination`), and the report says per task how many items its check examined and how many it could not,
and why (no document logged, no text, a question outside its family's template):

- text (an lm-eval document): lm-eval's decontamination (Janitor, after GPT-3) on its normalization (case folded,
  punctuation dropped, whitespace collapsed): an item overlaps when one of its word n-grams (N = 8 here, GPT-3's
  lower bound; lm-eval uses 13) appears in the prompts, in the answers, or across a prompt and its answer (the
  sequence a recovery trains on); an item under N tokens overlaps only when all of it appears.
- template (a probe item): its payload (the numbers, letters, words or brackets its template holds, digits to a
  placeholder of their length in the template's shape) found whole in any wording of its family's template ('What is
  81 - 50?' for '81 - 50 =', 'k, d, m' for 'k d m', 'Repeat:' for 'Copy:'). Probe tokens come from alphabets of a few
  symbols, so any 8 of them stand in many other items: the item is the unit. A payload of the same shape with one
  value changed is a near duplicate; near duplicates flag a task only beyond what chance gives in a family that small
  (`tasks.contamination.near_chance`). Recovery records holding the task's template with other values are counted
  too: a recovery that asks the task's kind of question trains its format (near transfer), if not its items.

An item is its question and its gold answer: a probe's question alone (its few-shot prefix left out; a question seen
is an item seen, whatever answer came with it); an lm-eval document's text fields of at least
`evaluate.overlap.MIN_FIELD_CHARS` characters (question, passage, a written-out answer), nested ones (ARC's choices)
included, joined; a document with no field that long, all its text but ids and labels. A task is flagged when at
least FLAG_SHARE of its examined items overlap: a share s of contaminated items can move its accuracy by at most s,
and below 1% that is under a point, well inside the standard error of the 100-500 items a task is scored on.

The teacher's answers are also measured for copying (a run of >= N consecutive tokens of their own prompt: the
`local` method regresses every position of prompt + answer, so answers that re-emit their prompt's items train the
skill of the list probes, copy, reverse and count) and repetition (rep-n, `analyze.metrics`). The list probes get a
near-transfer note at COPY_NOTE_SHARE: about the rate of Dolly's own human answers (4.6% of its first 3000 by this
definition, their `context` missing from the prompt), so the note says the teacher copies more than people did.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any

from layerprune.analyze.metrics import mean_or_none, rep_n, words
from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.evaluate.items import SAMPLES_DIR
from layerprune.evaluate.overlap import MIN_FIELD_CHARS, normalize
from layerprune.tasks.contamination import (
    PayloadIndex,
    document_strings,
    find_payloads,
    identifying,
    item_payload,
    janitor_tokens,
    near_chance,
    poisson_tail,
)
from layerprune.tasks.data import iter_jsonl
from layerprune.tasks.probes import EVAL_SEED, LIST_FAMILIES, family_of, generate_probes, probe_tasks

NGRAM = 8  # GPT-3's smallest N (it used 8-13 by item length); probe items are matched whole by their payload
FLAG_SHARE = 0.01  # flag a task when this share of its items overlaps: at most a point of accuracy below it
NEAR_P = 0.001  # near duplicates flag a task when chance alone gives that many this rarely
COPY_NOTE_SHARE = 0.05  # the near-transfer note on list probes when this share of teacher answers copies its prompt
REP_NS = (2, 3, 4)
AUDIT_FILE = "audit.json"
ARM_ANSWERS = "selfgen-"  # an arm's own teacher answers: selfgen-ARM[@rR].jsonl (a sweep's arm_prompts)
EVAL_LABEL = "baseline"  # the evaluation folder whose samples give the items (every model answered the same ones)
HELD_OUT = "held out (measured)"
NO_DOC = "no document in the samples log"
NO_TEXT = "no text"
NO_TEMPLATE = "question not in its family's template"


def gram_hashes(tokens: Sequence[str], size: int) -> set[int]:
    """The hashes of every run of `size` consecutive tokens (`analyze.metrics.ngrams`, without the lists)."""
    return set(map(hash, zip(*(tokens[i:] for i in range(size)), strict=False)))


class DataIndex:
    """The recovery data's token runs by length, built once per length asked for: those inside the prompts, inside
    the answers, and those across the two (the end of a prompt and the start of its answer, as trained)."""

    def __init__(self, prompts: Sequence[Sequence[str]], answers: Sequence[Sequence[str]]) -> None:
        self.prompts, self.answers = prompts, answers
        self._built: dict[int, tuple[set[int], set[int], set[int]]] = {}

    def at(self, size: int) -> tuple[set[int], set[int], set[int]]:
        if size not in self._built:
            self._built[size] = (
                set().union(*(gram_hashes(tokens, size) for tokens in self.prompts)),
                set().union(*(gram_hashes(tokens, size) for tokens in self.answers)),
                set().union(*(gram_hashes([*p[len(p) - size + 1:], *a[: size - 1]], size) if size > 1 else set()
                              for p, a in zip(self.prompts, self.answers, strict=True))))
        return self._built[size]


class PayloadData:
    """The probe templates' payloads in the recovery data: in the prompts, in the answers, across the two, and the
    records holding each shape."""

    def __init__(self, records: Sequence[dict[str, Any]]) -> None:
        prompts = [find_payloads(str(r["prompt"])) for r in records]
        answers = [find_payloads(str(r["response"])) for r in records]
        joined = [find_payloads(f"{r['prompt']}\n{r['response']}") for r in records]
        self.prompts, self.answers = PayloadIndex(chain(*prompts)), PayloadIndex(chain(*answers))
        self.across = PayloadIndex(chain(*joined))
        self.anywhere = PayloadIndex(chain(*prompts, *answers, *joined))
        self.record_shapes = [frozenset(p.shape for p in found) for found in joined]

    def records_in(self, shapes: set[str]) -> int:
        """How many records hold a payload of one of `shapes`."""
        return sum(bool(held & shapes) for held in self.record_shapes)


def longest_copied_span(prompt: Sequence[str], response: Sequence[str]) -> int:
    """The longest run of consecutive tokens of `response` that also stands, consecutively, in `prompt`."""
    positions: dict[str, list[int]] = defaultdict(list)
    for i, token in enumerate(prompt):
        positions[token].append(i)
    best, previous = 0, {}
    for token in response:
        current = {i: previous.get(i - 1, 0) + 1 for i in positions.get(token, ())}
        best = max(best, *current.values()) if current else best
        previous = current
    return best


def copy_stats(records: Sequence[dict[str, Any]], n: int = NGRAM) -> dict[str, Any]:
    """How much the teacher's answers copy their own prompts, and how repetitive they are (rep-n, mean over answers
    where defined)."""
    prompts, answers = [words(str(r["prompt"])) for r in records], [words(str(r["response"])) for r in records]
    spans = [longest_copied_span(p, a) for p, a in zip(prompts, answers, strict=True)]
    copying = sum(span >= n for span in spans)
    stats: dict[str, Any] = {"answers": len(answers), "copying": copying,
                             "share": copying / len(answers) if answers else None,
                             "mean_longest_span": sum(spans) / len(spans) if spans else None}
    for size in REP_NS:
        stats[f"rep_{size}"] = mean_or_none([rep_n(tokens, size) for tokens in answers])
    stats["mean_length_words"] = mean_or_none([float(len(tokens)) for tokens in answers])
    return stats


def found_shares(tokens: Sequence[str], data: DataIndex, n: int) -> tuple[float, float, bool]:
    """The shares of an item's n-grams (the whole item, under n tokens) found in the prompts and in the answers, and
    whether one is across a prompt and its answer."""
    grams = gram_hashes(tokens, min(n, len(tokens)))
    if not grams:
        return 0.0, 0.0, False
    prompts, answers, across = data.at(min(n, len(tokens)))
    return len(grams & prompts) / len(grams), len(grams & answers) / len(grams), bool(grams & across)


def _row(items: int, not_examined: Counter[str], check: str) -> dict[str, Any]:
    return {"items": items, "check": check, "examined": items - sum(not_examined.values()),
            "not_examined": dict(not_examined), "prompts": 0, "answers": 0, "either": 0,
            "max_prompts": 0.0, "max_answers": 0.0}


def _count(row: dict[str, Any], in_prompts: float, in_answers: float, across: bool) -> None:
    for where, share in (("prompts", in_prompts), ("answers", in_answers)):
        row[where] += share > 0
        row[f"max_{where}"] = max(row[f"max_{where}"], share)
    row["either"] += in_prompts > 0 or in_answers > 0 or across


def text_check(texts: Sequence[str | None], data: DataIndex, n: int) -> dict[str, Any]:
    """Documents whose normalized n-grams (all of an item under n tokens) appear in the prompts, in the answers, in
    either (across the two included), and the largest share of one item's n-grams found in each."""
    tokens = [None if text is None else janitor_tokens(text) for text in texts]
    row = _row(len(texts), Counter(NO_DOC if t is None else NO_TEXT for t in tokens if not t), "text")
    row["whole"] = sum(0 < len(t) < n for t in tokens if t)
    for item in (t for t in tokens if t):
        _count(row, *found_shares(item, data, n))
    return row


def template_check(task: str, questions: Sequence[str | None], data: PayloadData) -> dict[str, Any]:
    """Probe items whose payload stands whole in the prompts / the answers / across, those one value from a
    recovery payload (near) against how many chance would give, and the recovery records in the task's template."""
    family = family_of(task)
    payloads = [None if q is None else item_payload(q, family) for q in questions]
    row = _row(len(questions), Counter(NO_DOC if q is None else NO_TEMPLATE
                                       for q, p in zip(questions, payloads, strict=True) if p is None), "template")
    found = [p for p in payloads if p is not None]
    for payload in found:
        _count(row, float(payload in data.prompts.exact), float(payload in data.answers.exact),
               payload in data.across.exact)
    near = [p for p in found if p not in data.anywhere.exact and data.anywhere.near(p)]
    expected = sum(near_chance(p, data.anywhere.shapes[p.shape]) for p in found)
    shapes = {p.shape for p in found}
    row.update(near=len(near), near_expected=round(expected, 3), near_p=poisson_tail(len(near), expected),
               template_records=data.records_in(shapes))
    return row


def verdict(task: str, row: dict[str, Any], copying: float | None) -> tuple[bool, str]:
    """(flagged, the verdict line) of one task."""
    examined, why = row["examined"], "; ".join(f"{k} {r}" for r, k in row.get("not_examined", {}).items())
    if not examined:
        return False, f"not measured ({why or 'no items'})"
    if row["either"] >= FLAG_SHARE * examined:
        return True, f"FLAG: {task} items appear in the recovery prompts/answers ({row['either']} of {examined})"
    near = row.get("near", 0)
    if near >= FLAG_SHARE * examined and row["near_p"] < NEAR_P:
        return True, (f"FLAG: {near} of {examined} {task} items are one value from a recovery question (near "
                      f"duplicates; {row['near_expected']:.1f} expected by chance)")
    text = HELD_OUT if not row["either"] else (
        f"{HELD_OUT[:-1]}: {row['either']} of {examined} items overlap, under {FLAG_SHARE:.0%})")
    if row.get("template_records"):
        text += (f"; near transfer: {row['template_records']} recovery record(s) ask this task's kind of question "
                 f"with other values ({near} item(s) one value away, {row['near_expected']:.1f} expected by chance)")
    if why:
        text += f"; not examined: {why}"
    listing = task in probe_tasks() and family_of(task) in LIST_FAMILIES
    if listing and copying is not None and copying >= COPY_NOTE_SHARE:
        text += (f"; near transfer: {copying:.0%} of the teacher's answers copy their prompt, and a recovery that "
                     "regresses prompt + answer trains re-emitting items")
    return False, text


def audit_recovery_data(records: Sequence[dict[str, Any]], tasks: dict[str, Sequence[str | None]],
                        n: int = NGRAM) -> dict[str, Any]:
    """The audit of recovery records ({prompt, response}) against each task's item texts (None: an item whose
    document was not logged): per task what its check (text or template) examined, could not examine and found, and
    a verdict; over the records, copying and repetition (`copy_stats`)."""
    if n < 1:
        raise LayerpruneError(f"the audit's n-gram size must be at least 1, got {n}")
    data = DataIndex([janitor_tokens(str(r["prompt"])) for r in records],
                     [janitor_tokens(str(r["response"])) for r in records])
    payloads = PayloadData(records) if any(t in probe_tasks() for t in tasks) else None
    copying = copy_stats(records, n)
    rows = {}
    for task, texts in tasks.items():
        probe = payloads is not None and task in probe_tasks()
        row = template_check(task, texts, payloads) if payloads and probe else text_check(texts, data, n)
        row["share"] = row["either"] / row["examined"] if row["examined"] else None
        row["flagged"], row["verdict"] = verdict(task, row, copying["share"])
        rows[task] = row
    return {"n": n, "records": len(records), "tasks": rows, "copy": copying,
            "thresholds": {"flag_share": FLAG_SHARE, "near_p": NEAR_P, "copy_note_share": COPY_NOTE_SHARE},
            "definitions": {
                "text": f"lm-eval's normalization (case folded, punctuation dropped); an item shares a {n}-gram with "
                        f"the prompts, the answers or a prompt + answer (an item under {n} tokens: all of it)",
                "template": "a probe item's payload (numbers under a digits placeholder, letters, words, brackets) "
                            "whole in any wording of its family's template; near: one value changed",
                "copying": f"an answer holds a run of >= {n} consecutive tokens of its own prompt",
                "rep_n": "1 - unique/total word n-grams within an answer, mean over answers"}}


def item_text(task: str, sample: dict[str, Any]) -> str | None:
    """The question and gold answer of one logged lm-eval sample, a probe's question alone (None when it logged no
    document): its fields of MIN_FIELD_CHARS or more, else all its text but ids and labels."""
    doc = sample.get("doc")
    if not isinstance(doc, dict):
        return None
    if task in probe_tasks() and isinstance(doc.get("prompt"), str):
        return probe_question(doc["prompt"], task)
    texts = [s for s in document_strings(doc) if identifying(s)]
    target = sample.get("target")
    if isinstance(target, str) and identifying(target) and target not in texts:
        texts.append(target)
    long = [s for s in texts if len(normalize(s)) >= MIN_FIELD_CHARS]
    return "\n".join(long or texts)


@functools.cache
def question_lines(task: str) -> int:
    """How many lines a question of a probe task has."""
    return generate_probes(probe_tasks()[task], 1, EVAL_SEED)[0].question.count("\n") + 1


def probe_question(prompt: str, task: str) -> str:
    """A probe prompt's question: its last lines, as many as a question of that task has (the few-shot prefix before
    it is other draws of the same stream)."""
    return "\n".join(prompt.split("\n")[-question_lines(task):])


def task_items(folder: Path, task: str) -> list[str | None] | None:
    """The item texts of one evaluated task, one per document (lm-eval logs a document once per filter; None for one
    whose document it did not log), from `folder`/samples/`task`.jsonl; None when that file is not there."""
    path = folder / SAMPLES_DIR / f"{task}.jsonl"
    if not path.is_file():
        return None
    texts: dict[str, str | None] = {}
    for sample in iter_jsonl(path):
        key = f"{sample.get('subtask', '')}/{sample.get('doc_id')}"
        if texts.get(key) is None:
            texts[key] = item_text(task, sample)
    return list(texts.values())


def scored_tasks(root: Path) -> dict[str, Path]:
    """Every task any model of a study was scored on (eval/ and eval-chat/ folders), with the evaluation folder its
    items are read from: the baseline's where it has the task, else the first folder that does."""
    found: dict[str, Path] = {}
    for path in sorted(root.glob(f"eval*/*/{SAMPLES_DIR}/*.jsonl")):
        folder = path.parent.parent
        if path.stem not in found or folder.name == EVAL_LABEL and found[path.stem].name != EVAL_LABEL:
            found[path.stem] = folder
    return found


def recovery_records(root: Path) -> tuple[Path, list[dict[str, Any]]]:
    """The teacher's answers of a study (selfgen.jsonl, shared by its arms; else the first arm's kept ones)."""
    candidates = [root / "selfgen.jsonl", *sorted((root / "arms").glob("*/data/responses.jsonl"))]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise LayerpruneError(f"{root}: no teacher answers to audit (selfgen.jsonl or arms/*/data/responses.jsonl)")
    return path, answer_records(path)


def answer_records(path: Path) -> list[dict[str, Any]]:
    """The {prompt, response} records of a teacher-answer file."""
    return [r for r in iter_jsonl(path) if isinstance(r.get("response"), str) and "prompt" in r]


def audit_folder(root: Path, records_root: Path, tasks: list[str] | None = None, n: int = NGRAM) -> dict[str, Any]:
    """The audit of every task scored in `root` (`scored_tasks`; only `tasks` when given, a task without samples
    listed as not measured) against the teacher answers of `records_root`; with arms trained on prompts of their own
    (selfgen-ARM.jsonl, a sweep's arm_prompts), each of those answer sets audited the same way under "arms"."""
    source, records = recovery_records(records_root)
    scored = scored_tasks(root)
    folders = {t: scored.get(t, root / "eval" / EVAL_LABEL) for t in (sorted(scored) if tasks is None else tasks)}
    found = {task: task_items(folder, task) for task, folder in folders.items()}
    audit = audit_source(source, records, found, n)
    arms = {path.stem.removeprefix(ARM_ANSWERS): path for path in sorted(records_root.glob(f"{ARM_ANSWERS}*.jsonl"))}
    if arms:
        audit["arms"] = {arm: audit_source(path, answer_records(path), found, n) for arm, path in arms.items()}
    audit["items_from"] = {t: str(folder.relative_to(root)) for t, folder in folders.items()}
    return audit


def audit_source(source: Path, records: list[dict[str, Any]], found: dict[str, list[str | None] | None],
                 n: int) -> dict[str, Any]:
    """One answer set's audit against the items `found` per task (None: the task has no per-item samples)."""
    audit = audit_recovery_data(records, {t: items for t, items in found.items() if items is not None}, n)
    for task in (t for t, items in found.items() if items is None):
        audit["tasks"][task] = {"items": 0, "examined": 0, "flagged": False,
                                "verdict": f"not measured (no {SAMPLES_DIR}/{task}.jsonl)"}
    audit["source"] = str(source)
    # the data itself is not archived: a later audit of regenerated answers is this audit only where the digest agrees
    audit["source_sha256"] = hashlib.sha256(source.read_bytes()).hexdigest()
    return audit


def audit_study(root: Path, tasks: list[str] | None = None, n: int = NGRAM) -> dict[str, Any]:
    """Audit a study or sweep folder's recovery data (every teacher answer, the recovery's held-out ones included)
    against the items of every task its models were scored on (the baseline's items where it has them); writes
    `audit.json` in `root` and returns it."""
    audit = audit_folder(root, root, tasks, n)
    write_atomic(root / AUDIT_FILE, json.dumps(audit, indent=1) + "\n")
    return audit


def records_root(root: Path, others: Sequence[Path] = ()) -> Path:
    """Where the teacher answers of `root`'s models are: `root`, else a folder of the same recipe fingerprint
    (run.json) among `others` or at the recipe's own `output` (a folder of tasks scored after a sweep, laid out as
    the sweep's, holds its run.json and no teacher answers)."""
    try:
        recovery_records(root)
        return root
    except LayerpruneError as err:
        state = _run_state(root)
        output = state.get("recipe", {}).get("output")
        for other in [*others, *([Path(output), root.parent / Path(output).name] if output else [])]:
            if other != root and state and _run_state(other).get("fingerprint") == state.get("fingerprint"):
                try:
                    recovery_records(other)
                    return other
                except LayerpruneError:
                    continue
        raise LayerpruneError(f"{err}; nor a folder of its recipe (run.json fingerprint) that holds them") from None


def _run_state(root: Path) -> dict[str, Any]:
    try:
        state = json.loads((root / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def audit_runs(roots: Sequence[Path]) -> dict[str, Any]:
    """Per run folder of a join (`layerprune analyze sweeps`), the audit of every task scored there against the
    teacher answers its models trained on (`records_root`), or why it could not be audited."""
    audits: dict[str, Any] = {}
    for root in roots:
        try:
            audits[str(root)] = audit_folder(root, records_root(root, roots))
        except LayerpruneError as err:
            kept = root / AUDIT_FILE  # a run unpacked from its records (the answers left out): its audit as made
            audits[str(root)] = json.loads(kept.read_text()) if kept.is_file() else {
                "error": str(err), "tasks": sorted(scored_tasks(root))}
    return audits
