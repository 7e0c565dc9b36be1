"""Calibration data: GSM8K train, generated arithmetic probes, generic text, or a JSONL file."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import Registry, check_name
from layerprune.models.walker import CalibBatch
from layerprune.tasks.data import load_rows, local_split, read_jsonl
from layerprune.tasks.grading import final_number
from layerprune.tasks.probes import arithmetic_probes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibItem:
    """A text to score whole (answer None), or a prompt whose answer alone is scored."""

    prompt: str
    answer: str | None = None
    expected: str | None = None  # exact-match target for --metric accuracy
    stop: str = "\n"  # generation is cut here before the answer is read


@dataclass
class CalibSet:
    items: list[CalibItem]
    description: str
    fallback: str | None = None  # why --calib auto used another source than GSM8K train

    def record(self) -> list[dict[str, str]]:
        """The items as prune_report.json lists them: text, or prompt and answer."""
        return [{"text": i.prompt} if i.answer is None else {"prompt": i.prompt, "answer": i.answer}
                for i in self.items]


CALIB_SOURCES: Registry[Callable[[int, int, Path | None], CalibSet]] = Registry("calibration source")


@CALIB_SOURCES.register("gsm8k")
def gsm8k_calib(n: int, seed: int, data_dir: Path | None) -> CalibSet:
    rows = load_rows("gsm8k", "train", data_dir)  # train only: test items are for evaluation
    picked = random.Random(seed).sample(rows, min(n, len(rows)))
    items = [
        CalibItem(f"Question: {r['question']}\nAnswer:", " " + r["answer"].strip(), final_number(r["answer"]),
                  "\nQuestion:")
        for r in picked
    ]
    where = local_split(data_dir, "gsm8k", "train") or "hub openai/gsm8k"
    return CalibSet(items, f"gsm8k train ({where}), {len(items)} question+answer pairs, NLL on answers")


@CALIB_SOURCES.register("arithmetic")
def arithmetic_calib(n: int, seed: int, data_dir: Path | None) -> CalibSet:
    probes = arithmetic_probes(n, seed=seed, stream="calib")  # own stream; never an evaluation probe's question
    items = [CalibItem(p.prompt, p.answer, p.answer.strip()) for p in probes]
    return CalibSet(items, f"generated arithmetic probes (3-shot composites, calibration stream, seed {seed}; "
                           f"no evaluation probe among them), {len(items)} items")


@CALIB_SOURCES.register("text")
def text_calib(n: int, seed: int, data_dir: Path | None) -> CalibSet:
    rows = load_rows("dolly", "train", data_dir)
    picked = random.Random(seed).sample(rows, min(n, len(rows)))
    items = [CalibItem(f"{r['instruction']}\n{r['response']}") for r in picked]
    return CalibSet(items, f"generic text: dolly instruction+response, {len(items)} texts")


def jsonl_calib(path: Path, n: int, seed: int) -> CalibSet:
    """A JSONL file of {"text"} or {"prompt", "answer"} rows."""
    rows = read_jsonl(path)
    items = []
    for number, row in enumerate(rows, 1):
        if isinstance(row.get("text"), str) and row["text"].strip():
            items.append(CalibItem(row["text"]))
        elif isinstance(row.get("prompt"), str) and isinstance(row.get("answer"), str):
            items.append(CalibItem(row["prompt"], row["answer"], final_number(row["answer"]) or None))
        else:
            raise LayerpruneError(f"{path}:{number}: expected a 'text' field or 'prompt' and 'answer' fields")
    picked = items if len(items) <= n else random.Random(seed).sample(items, n)
    return CalibSet(picked, f"JSONL file {path}, {len(picked)} items")


def load_calibration(name: str | None, n: int, seed: int, data_dir: Path | None) -> CalibSet:
    """The named source, a JSONL path, or (None/'auto') GSM8K train when reachable, else arithmetic probes."""
    if name in (None, "auto"):
        try:
            calib = gsm8k_calib(n, seed, data_dir)
        except LayerpruneError as exc:
            log.warning("GSM8K train not reachable (%s); using generated arithmetic probes", exc)
            calib = arithmetic_calib(n, seed, data_dir)
            calib.fallback = f"--calib auto: GSM8K train not reachable ({exc}); used generated arithmetic probes"
            calib.description = f"{calib.description} [{calib.fallback}]"
        return calib
    if "+" in name:
        return mix_calibration(name.split("+"), n, seed, data_dir)
    if is_calibration_file(name):
        return jsonl_calib(Path(name), n, seed)
    return CALIB_SOURCES.get(name)(n, seed, data_dir)


def is_calibration_file(name: str) -> bool:
    """Whether `--calib NAME` names a JSONL file rather than a source."""
    return name.endswith(".jsonl") or Path(name).is_file()


def check_calibration(name: str) -> str:
    """`name` when load_calibration knows it (auto, a source, a JSONL file, or a mix of them joined by '+'), else a
    ValueError with the close matches."""
    for part in name.split("+"):
        if part != "auto" and not is_calibration_file(part):
            check_name(CALIB_SOURCES.kind, part, ["auto", *CALIB_SOURCES.names()])
    return name


def mix_calibration(names: list[str], n: int, seed: int, data_dir: Path | None) -> CalibSet:
    """'gsm8k+arithmetic': an equal share of `n` from each source."""
    counts = [n // len(names) + (i < n % len(names)) for i in range(len(names))]
    parts = [load_calibration(name, count, seed, data_dir) for name, count in zip(names, counts, strict=True)]
    fallbacks = [part.fallback for part in parts if part.fallback]
    return CalibSet(
        [item for part in parts for item in part.items],
        " + ".join(part.description for part in parts),
        "; ".join(fallbacks) or None,
    )


def tokenize_calibration(calib: CalibSet, tokenizer, seq_len: int, batch_size: int) -> list[CalibBatch]:  # noqa: ANN001
    """Right-padded batches, sorted by length; the loss mask covers answers (or whole texts)."""
    encoded = [_encode(item, tokenizer, seq_len) for item in calib.items]
    encoded = [e for e in encoded if e[1].sum() > 0]
    if not encoded:
        raise LayerpruneError("calibration data has no scorable tokens (answers cut off by --calib-seq-len?)")
    encoded.sort(key=lambda e: len(e[0]))
    return [_collate(encoded[i : i + batch_size], tokenizer.pad_token_id) for i in range(0, len(encoded), batch_size)]


def _encode(item: CalibItem, tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and _adds_bos(tokenizer) else []
    prompt = bos + tokenizer(item.prompt, add_special_tokens=False)["input_ids"]
    answer = tokenizer(item.answer, add_special_tokens=False)["input_ids"] if item.answer else []
    ids = (prompt + answer)[:seq_len]
    scored = [0] * len(prompt) + [1] * len(answer) if item.answer else [0] * len(bos) + [1] * (len(prompt) - len(bos))
    return torch.tensor(ids), torch.tensor(scored[:seq_len])


def _adds_bos(tokenizer) -> bool:  # noqa: ANN001
    probe = tokenizer("a")["input_ids"]
    return bool(probe) and probe[0] == tokenizer.bos_token_id


def _collate(rows: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int) -> CalibBatch:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (tokens, scored) in enumerate(rows):
        ids[row, : len(tokens)] = tokens
        attn[row, : len(tokens)] = 1
        loss[row, : len(tokens)] = scored
    return CalibBatch(ids, attn, loss)


def is_short_answer(item: CalibItem) -> bool:
    """An item whose whole answer is the expected string: greedy exact match can be decided teacher-forced."""
    return item.answer is not None and item.expected is not None and item.answer.strip() == item.expected


@dataclass
class AnswerBatch:
    """Prompt+answer rows (answer tokens scored) for teacher-forced exact match, and which items they are."""

    batch: CalibBatch
    needs_stop: torch.Tensor  # the answer is shorter than the decode budget: a stop must follow it
    fits: torch.Tensor  # the answer fits in the decode budget at all
    items: list[int]


def answer_batches(items: list[CalibItem], tokenizer, batch_size: int, max_new_tokens: int) -> list[AnswerBatch]:  # noqa: ANN001
    """Right-padded batches of short-answer items, sorted by length, untruncated."""
    encoded = sorted(((len(e[0]), i, e) for i, e in enumerate(_encode(item, tokenizer, 1 << 30) for item in items)))
    batches = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        answer_lengths = torch.tensor([int(e[1].sum()) for _, _, e in chunk])
        batches.append(
            AnswerBatch(
                _collate([e for _, _, e in chunk], tokenizer.pad_token_id),
                answer_lengths < max_new_tokens,
                answer_lengths <= max_new_tokens,
                [i for _, i, _ in chunk],
            )
        )
    return batches


def stop_token_mask(tokenizer, stop: str, size: int, end_ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Over a vocabulary of `size`: tokens that end a greedy answer, i.e. whose text starts with `stop` (after
    spaces) or that end the sequence (`end_ids`)."""
    texts = tokenizer.batch_decode([[i] for i in range(min(size, len(tokenizer)))])
    mask = torch.zeros(size, dtype=torch.bool)
    mask[: len(texts)] = torch.tensor([text.lstrip(" \t").startswith(stop) for text in texts])
    mask[[i for i in end_ids if 0 <= i < size]] = True
    return mask
