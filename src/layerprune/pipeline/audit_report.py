"""The held-out audit (pipeline/audit.py) as markdown: a study's or sweep's section, and a join's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.pipeline.audit import (
    AUDIT_FILE,
    COPY_NOTE_SHARE,
    FLAG_SHARE,
    REP_NS,
    audit_study,
    recovery_records,
)
from layerprune.tasks.probes import LIST_FAMILIES


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _not_examined(row: dict[str, Any]) -> str:
    reasons = row.get("not_examined") or {}
    return "; ".join(f"{count} ({why})" for why, count in reasons.items()) or "0"


def _near(row: dict[str, Any]) -> str:
    return "-" if "near" not in row else f"{row['near']} ({row['near_expected']:.1f})"


def task_line(task: str, row: dict[str, Any]) -> str:
    """One task's row of the audit table."""
    if not row.get("examined"):
        return f"| {task} | {row['items']} | - | - | - | - | - | - | {_not_examined(row)} | {row['verdict']} |"
    return (f"| {task} | {row['items']} | {row['prompts']} | {row['answers']} | {row['either']} | "
            f"{_pct(row['max_prompts'])} / {_pct(row['max_answers'])} | {_near(row)} | "
            f"{row.get('template_records', '-')} | {_not_examined(row)} | {row['verdict']} |")


TABLE = ["| task | items | in prompts | in answers | either | largest share of one item (prompts / answers) | near "
         "(expected) | template records | not examined | verdict |", "|---" * 10 + "|"]


def audit_lines(audit: dict[str, Any]) -> list[str]:
    """The audit as a markdown section for study.md / sweep.md."""
    n, copy = audit["n"], audit["copy"]
    lines = ["## Held out, measured", "",
             f"Each scored task's items (a document's question and gold answer, a probe's question) against the "
             f"{audit['records']} recovery prompts and the teacher's answers, on normalized text. A document overlaps "
             f"when one of its {n}-grams (case folded, punctuation dropped, as lm-eval's decontamination; an item "
             f"under {n} tokens: all of it) appears in a prompt, in an answer, or across a prompt and its answer (the "
             "sequence trained on; 'either' counts all three). A probe item overlaps when its values (numbers, "
             "letters, brackets) stand whole in any wording of its family's template ('What is 81 - 50?' for '81 - "
             "50 ='); near: one value changed (with the number chance gives); template records: recovery records "
             f"asking the task's kind of question. A task is flagged at {FLAG_SHARE:.0%} of its examined items or "
             "more, or for near duplicates beyond chance.", "",
             *TABLE]
    lines += [task_line(task, row) for task, row in audit["tasks"].items()]
    rep = ", ".join(f"rep-{k} {copy[f'rep_{k}']:.3f}" for k in REP_NS if copy.get(f"rep_{k}") is not None)
    lines += ["", f"Teacher answers that copy a run of >= {n} tokens of their own prompt: {copy['copying']} of "
              f"{copy['answers']} ({_pct(copy['share'])}); mean longest copied run "
              + ("-" if copy["mean_longest_span"] is None else f"{copy['mean_longest_span']:.1f}")
              + f" tokens; repetition of the answers: {rep or '-'}."]
    if copy["share"] is not None and copy["share"] >= COPY_NOTE_SHARE:
        lines.append(f"At {_pct(copy['share'])} (the note's threshold {COPY_NOTE_SHARE:.0%}), the list probes "
                     f"({', '.join(LIST_FAMILIES)}) are near transfer, not held-out skills: a recovery that "
                     "regresses every position of prompt + answer learns to re-emit the prompt's items.")
    for arm, own in audit.get("arms", {}).items():
        lines += ["", f"Arm {arm}, trained on answers to prompts of its own ({own['records']} records, "
                      f"{Path(own['source']).name}): the same checks.", "", *TABLE,
                  *(task_line(task, row) for task, row in own["tasks"].items())]
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


def join_audit_lines(audits: dict[str, Any]) -> list[str]:
    """The audits of a join's run folders (`audit.audit_runs`), one section each, or why a folder was not audited."""
    lines = []
    for root, audit in audits.items():
        if "error" in audit:
            lines += [f"## Held out, measured: {root}", "",
                      f"Not audited ({', '.join(audit['tasks']) or 'no scored task'}): {audit['error']}.", ""]
            continue
        section = audit_lines(audit)
        lines += [f"{section[0]}: {root}", "", f"Teacher answers: {audit['source']}.", *section[1:], ""]
    return lines
