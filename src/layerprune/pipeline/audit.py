"""Held out, measured: the recovery data (prompts and the teacher's answers) against every scored task's items.

A task is held out when its evaluated items do not appear in what the recovery trained on, not when no recovery
prompt was drawn from its name. The test is lm-eval's decontamination (Janitor, after GPT-3): an item overlaps
when one of its word n-grams (N = 8 here, GPT-3's lower bound; lm-eval uses 13) appears in the prompts, in the
answers, or across a prompt and its answer (the sequence a recovery trains on). Two departures, both for this
project's symbolic probes: tokens are `analyze.metrics.words` (lower-cased words and single punctuation marks;
lm-eval deletes punctuation, which would erase every bracket and operator of a probe item), and a probe item (or any
item under N tokens) overlaps only when all of it appears, token for token: its tokens come from an alphabet of a
few symbols, so any 8 of them stand in many other items (by 8-grams, each of 60 depth-7 bracket questions
'overlapped' 60 calibration-stream prompts that hold none of them), and the item is the unit.

An item is its question and its gold answer: a probe's question alone (its few-shot prefix left out; its answer
follows from it, and a question seen is an item seen, whatever answer came with it); an lm-eval document's text
fields of at least `evaluate.overlap.MIN_FIELD_CHARS` characters (question, passage, a written-out answer; labels
and ids are shorter), joined. A task is flagged when at least FLAG_SHARE of its items overlap: a share s of
contaminated items can move its accuracy by at most s, and below 1% that is under a point, well inside the
standard error of the 100-500 items a task is scored on.

The teacher's answers are also measured for copying (a run of >= N consecutive tokens of their own prompt: the
`local` method regresses every position of prompt + answer, so answers that re-emit their prompt's items train the
skill of the list probes, copy, reverse and count) and repetition (rep-n, `analyze.metrics`). The list probes get a
near-transfer note at COPY_NOTE_SHARE: about the rate of Dolly's own human answers (4.6% of its first 3000 by this
definition, their `context` missing from the prompt), so the note says the teacher copies more than people did.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layerprune.analyze.metrics import mean_or_none, rep_n, words
from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.evaluate.items import SAMPLES_DIR
from layerprune.evaluate.overlap import MIN_FIELD_CHARS, normalize
from layerprune.tasks.data import iter_jsonl
from layerprune.tasks.probes import EVAL_SEED, LIST_FAMILIES, generate_probes, probe_tasks

NGRAM = 8  # GPT-3's smallest N (it used 8-13 by item length); probe items are shorter, matched whole
FLAG_SHARE = 0.01  # flag a task when this share of its items overlaps: at most a point of accuracy below it
COPY_NOTE_SHARE = 0.05  # the near-transfer note on list probes when this share of teacher answers copies its prompt
REP_NS = (2, 3, 4)
AUDIT_FILE = "audit.json"
EVAL_LABEL = "baseline"  # the evaluation folder whose samples give the items (every model answered the same ones)
HELD_OUT = "held out (measured)"


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


def gram_size(whole: bool, tokens: Sequence[str], n: int) -> int:
    """n, or the item's whole length: for a probe (`whole`: a few symbols of a small alphabet, so that any n of them
    stand in many other items; the item is the unit) and for an item shorter than n."""
    return len(tokens) if whole else min(n, len(tokens))


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
    return _copy_stats([words(str(r["prompt"])) for r in records], [words(str(r["response"])) for r in records], n)


def _copy_stats(prompts: list[list[str]], answers: list[list[str]], n: int) -> dict[str, Any]:
    spans = [longest_copied_span(p, a) for p, a in zip(prompts, answers, strict=True)]
    copying = sum(span >= n for span in spans)
    stats: dict[str, Any] = {"answers": len(answers), "copying": copying,
                             "share": copying / len(answers) if answers else None,
                             "mean_longest_span": sum(spans) / len(spans) if spans else None}
    for size in REP_NS:
        stats[f"rep_{size}"] = mean_or_none([rep_n(tokens, size) for tokens in answers])
    stats["mean_length_words"] = mean_or_none([float(len(tokens)) for tokens in answers])
    return stats


def found_shares(tokens: Sequence[str], size: int, data: DataIndex, n: int) -> tuple[float, float, bool]:
    """The shares of an item's grams of `size` tokens found in the prompts and in the answers, and whether one is
    across a prompt and its answer. A whole item longer than n is looked for only where its first n tokens stand."""
    grams = gram_hashes(tokens, size)
    if not grams:
        return 0.0, 0.0, False
    if size > n and not any(hash(tuple(tokens[:n])) in found for found in data.at(n)):
        return 0.0, 0.0, False
    prompts, answers, across = data.at(size)
    return len(grams & prompts) / len(grams), len(grams & answers) / len(grams), bool(grams & across)


def task_overlap(items: Sequence[Sequence[str]], sizes: Sequence[int], data: DataIndex, n: int) -> dict[str, Any]:
    """Items (token lists, each with its gram size) whose grams appear in the prompts, in the answers, in either
    (across the two included), and the largest share of one item's grams found in the prompts and in the answers."""
    counts = {"prompts": 0, "answers": 0, "either": 0}
    most = {"prompts": 0.0, "answers": 0.0}
    for tokens, size in zip(items, sizes, strict=True):
        in_prompts, in_answers, across = found_shares(tokens, size, data, n)
        for where, share in (("prompts", in_prompts), ("answers", in_answers)):
            counts[where] += share > 0
            most[where] = max(most[where], share)
        counts["either"] += in_prompts > 0 or in_answers > 0 or across
    return {"items": len(items), **counts, "share": counts["either"] / len(items) if items else None,
            "max_prompts": most["prompts"], "max_answers": most["answers"]}


def verdict(task: str, row: dict[str, Any], copying: float | None) -> tuple[bool, str]:
    """(flagged, the verdict line) of one task."""
    if not row["items"]:
        return False, "not measured (no items)"
    if row["either"] >= FLAG_SHARE * row["items"]:
        return True, f"FLAG: {task} items appear in the recovery prompts/answers ({row['either']} of {row['items']})"
    text = HELD_OUT if not row["either"] else (
        f"{HELD_OUT[:-1]}: {row['either']} of {row['items']} items overlap, under {FLAG_SHARE:.0%})")
    family = probe_tasks().get(task, {}).get("family")
    if family in LIST_FAMILIES and copying is not None and copying >= COPY_NOTE_SHARE:
        text += (f"; near transfer: {copying:.0%} of the teacher's answers copy their prompt, and a recovery that "
                 "regresses prompt + answer trains re-emitting items")
    return False, text


def audit_recovery_data(records: Sequence[dict[str, Any]], tasks: dict[str, list[str]],
                        n: int = NGRAM) -> dict[str, Any]:
    """The audit of recovery records ({prompt, response}) against each task's item texts: per task the items
    overlapping the prompts / the answers (n-grams of `words` tokens, items under n tokens matched whole), the
    largest share of one item found, and a verdict; over the records, copying and repetition (`copy_stats`)."""
    if n < 1:
        raise LayerpruneError(f"the audit's n-gram size must be at least 1, got {n}")
    prompt_tokens = [words(str(r["prompt"])) for r in records]
    answer_tokens = [words(str(r["response"])) for r in records]
    data = DataIndex(prompt_tokens, answer_tokens)
    copying = _copy_stats(prompt_tokens, answer_tokens, n)
    rows = {}
    for task, texts in tasks.items():
        items, whole = [words(text) for text in texts], task in probe_tasks()
        row = task_overlap(items, [gram_size(whole, tokens, n) for tokens in items], data, n)
        row["flagged"], row["verdict"] = verdict(task, row, copying["share"])
        rows[task] = row
    return {"n": n, "records": len(records), "tasks": rows, "copy": copying,
            "thresholds": {"flag_share": FLAG_SHARE, "copy_note_share": COPY_NOTE_SHARE},
            "definitions": {"tokens": "analyze.metrics.words: lower-cased words and single punctuation marks",
                            "overlap": f"an item shares a {n}-gram with the prompts, the answers or a prompt + "
                                       f"answer (a probe item, or an item under {n} tokens: all of it)",
                            "copying": f"an answer holds a run of >= {n} consecutive tokens of its own prompt",
                            "rep_n": "1 - unique/total word n-grams within an answer, mean over answers"}}


@functools.cache
def question_lines(task: str) -> int:
    """How many lines a question of a probe task has."""
    return generate_probes(probe_tasks()[task], 1, EVAL_SEED)[0].question.count("\n") + 1


def probe_question(prompt: str, task: str) -> str:
    """A probe prompt's question: its last lines, as many as a question of that task has (the few-shot prefix before
    it is other draws of the same stream)."""
    return "\n".join(prompt.split("\n")[-question_lines(task):])


def item_text(task: str, sample: dict[str, Any]) -> str | None:
    """The question and gold answer of one logged lm-eval sample, a probe's question alone (None when it logged no
    document)."""
    doc = sample.get("doc")
    if not isinstance(doc, dict):
        return None
    if task in probe_tasks() and isinstance(doc.get("prompt"), str):
        return probe_question(doc["prompt"], task)
    fields = [v for v in doc.values() if isinstance(v, str) and len(normalize(v)) >= MIN_FIELD_CHARS]
    target = sample.get("target")
    if isinstance(target, str) and len(normalize(target)) >= MIN_FIELD_CHARS and target not in fields:
        fields.append(target)
    return "\n".join(fields) or None


def task_items(folder: Path, task: str) -> list[str] | None:
    """The item texts of one evaluated task, one per document (lm-eval logs a document once per filter), from
    `folder`/samples/`task`.jsonl; None when that file is not there."""
    path = folder / SAMPLES_DIR / f"{task}.jsonl"
    if not path.is_file():
        return None
    texts: dict[str, str] = {}
    for sample in iter_jsonl(path):
        key = f"{sample.get('subtask', '')}/{sample.get('doc_id')}"
        if key not in texts and (text := item_text(task, sample)) is not None:
            texts[key] = text
    return list(texts.values())


def recovery_records(root: Path) -> tuple[Path, list[dict[str, Any]]]:
    """The teacher's answers of a study (selfgen.jsonl, shared by its arms; else the first arm's kept ones)."""
    candidates = [root / "selfgen.jsonl", *sorted((root / "arms").glob("*/data/responses.jsonl"))]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise LayerpruneError(f"{root}: no teacher answers to audit (selfgen.jsonl or arms/*/data/responses.jsonl)")
    return path, [r for r in iter_jsonl(path) if isinstance(r.get("response"), str) and "prompt" in r]


def audit_study(root: Path, tasks: list[str] | None = None, n: int = NGRAM) -> dict[str, Any]:
    """Audit a study or sweep folder's recovery data (every teacher answer, the recovery's held-out ones included)
    against the items its baseline answered (eval/baseline/samples; every task there when `tasks` is None); writes
    `audit.json` in `root` and returns it. A task without samples is listed as not measured."""
    source, records = recovery_records(root)
    folder = root / "eval" / EVAL_LABEL
    if tasks is None:
        tasks = sorted(p.stem for p in (folder / SAMPLES_DIR).glob("*.jsonl"))
    found = {task: task_items(folder, task) for task in tasks}
    audit = audit_recovery_data(records, {t: items for t, items in found.items() if items is not None}, n)
    for task in (t for t, items in found.items() if items is None):
        audit["tasks"][task] = {"items": 0, "flagged": False,
                                "verdict": f"not measured (no {SAMPLES_DIR}/{task}.jsonl)"}
    audit["source"] = str(source)
    write_atomic(root / AUDIT_FILE, json.dumps(audit, indent=1) + "\n")
    return audit


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def audit_lines(audit: dict[str, Any]) -> list[str]:
    """The audit as a markdown section for study.md / sweep.md."""
    n, copy = audit["n"], audit["copy"]
    lines = ["## Held out, measured", "",
             f"Each scored task's items (a document's question and gold answer, a probe's question) against the "
             f"{audit['records']} recovery prompts and the teacher's answers: an item overlaps when one of its "
             f"{n}-grams (lower-cased words and punctuation; a probe item, or one under {n} tokens: all of it) appears "
             f"in a prompt, in an answer, or across a prompt and its answer (the sequence trained on; 'either' counts "
             f"all three). A task is flagged at {FLAG_SHARE:.0%} of its items or more.", "",
             "| task | items | in prompts | in answers | either | largest share of one item (prompts / answers) "
             "| verdict |", "|---|---|---|---|---|---|---|"]
    for task, row in audit["tasks"].items():
        if not row["items"]:
            lines.append(f"| {task} | 0 | - | - | - | - | {row['verdict']} |")
            continue
        lines.append(f"| {task} | {row['items']} | {row['prompts']} | {row['answers']} | {row['either']} | "
                     f"{_pct(row['max_prompts'])} / {_pct(row['max_answers'])} | {row['verdict']} |")
    rep = ", ".join(f"rep-{k} {copy[f'rep_{k}']:.3f}" for k in REP_NS if copy.get(f"rep_{k}") is not None)
    lines += ["", f"Teacher answers that copy a run of >= {n} tokens of their own prompt: {copy['copying']} of "
              f"{copy['answers']} ({_pct(copy['share'])}); mean longest copied run "
              + ("-" if copy["mean_longest_span"] is None else f"{copy['mean_longest_span']:.1f}")
              + f" tokens; repetition of the answers: {rep or '-'}."]
    if copy["share"] is not None and copy["share"] >= COPY_NOTE_SHARE:
        lines.append(f"At {_pct(copy['share'])} (the note's threshold {COPY_NOTE_SHARE:.0%}), the list probes "
                     f"({', '.join(LIST_FAMILIES)}) are near transfer, not held-out skills: a recovery that "
                     "regresses every position of prompt + answer learns to re-emit the prompt's items.")
    return lines


def audit_section(root: Path, tasks: list[str] | None = None) -> list[str]:
    """`audit_lines` of `audit_study` (audit.json written); where the folder holds no teacher answers, those of the
    audit.json it keeps (a run unpacked from its records, which leave the answers out), else no lines (a study of
    training-free arms only, or before any recovery ran)."""
    try:
        recovery_records(root)
    except LayerpruneError:
        kept = root / AUDIT_FILE
        return ["", *audit_lines(json.loads(kept.read_text()))] if kept.is_file() else []
    return ["", *audit_lines(audit_study(root, tasks))]
