"""Shared test helpers: skip-reference logits, directory fingerprints, CLI runs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from layerprune.cli import main
from layerprune.models import find_decoder_stack


def skip_reference_logits(model, input_ids: torch.Tensor, skip: Sequence[int]) -> torch.Tensor:  # noqa: ANN001
    """Logits of the full model with each skipped block's output replaced by its input."""
    handles = []
    for index in skip:
        def hook(module, args, kwargs, output):  # noqa: ANN001, ANN202
            hidden = args[0] if args else kwargs["hidden_states"]
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        handles.append(find_decoder_stack(model).layers[index].register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            return model(input_ids=input_ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()


def fingerprint(path: Path) -> dict[str, str]:
    """Every file under `path` with its sha256 (to check an input was left untouched)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def run_cli(capsys, argv: Sequence[str]) -> tuple[int, str, str]:  # noqa: ANN001
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def evaluate_cli(capsys, *argv: str) -> tuple[int, str, str]:  # noqa: ANN001
    """`layerprune evaluate ARGV` in-process: exit code, stdout, stderr (what fixtures printed before left out)."""
    capsys.readouterr()
    return run_cli(capsys, ["evaluate", *argv])


def write_rows(root: Path, dataset: str, split: str, rows: list[dict]) -> Path:
    """<root>/<dataset>/<split>.jsonl, as the data mirror lays out a hub split."""
    path = root / dataset / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert code == 2, err
    assert len(lines) == 1, err
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]


def pruned_copy(teacher: Path, out: Path, dropped: list[int]) -> Path:
    """`teacher` minus the `dropped` blocks saved to `out`, with the prune_report.json that names `teacher`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layerprune.models import drop_blocks

    model = AutoModelForCausalLM.from_pretrained(teacher)
    before = model.config.num_hidden_layers
    kept = drop_blocks(model, dropped)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(out)
    write_lineage(out, teacher, dropped, list(kept), before)
    return out


def make_pruned_student(teacher: Path, out: Path) -> Path:
    """`teacher` minus blocks 2 and 3, with the prune_report.json naming it, and prompts.jsonl next to it."""
    import json

    pruned_copy(teacher, out, [2, 3])
    rows = [{"prompt": f"what is {i} + 7?", "answer": str(i + 7)} for i in range(12)]
    (out.parent / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def write_lineage(out: Path, teacher: Path, dropped: list[int], kept: list[int], before: int) -> None:
    """The prune_report.json a pruned directory needs for recover: `teacher` as its source, `dropped` by index."""
    from layerprune.core.provenance import collect_provenance
    from layerprune.core.reports import write_report
    from layerprune.models.lineage import PRUNE_REPORT, PrunedLineage, PruneMethod, SourceRecord

    source = SourceRecord(spec=str(teacher), location=str(teacher), kind="local", identity={})
    write_report(
        out / PRUNE_REPORT,
        PrunedLineage(
            source=source,
            method=PruneMethod(score="explicit"),
            calibration=None,
            dropped=dropped,
            kept=kept,
            num_blocks_before=before,
            num_blocks_after=len(kept),
            provenance=collect_provenance(),
        ),
    )
