"""Several models in one call: each evaluated (cached), then compared when there is more than one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from layerprune.core.outputs import atomic_output_dir, check_output_dir, input_paths
from layerprune.core.settings import RunSettings
from layerprune.evaluate.overlap import calibration_overlap
from layerprune.evaluate.report import compare, format_table
from layerprune.evaluate.runner import evaluate_model
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import plan_tasks
from layerprune.evaluate.summary import Summary
from layerprune.models import resolve_model
from layerprune.models.loading import load_tokenizer
from layerprune.tasks.data import resolve_data_dir

log = logging.getLogger(__name__)


def tokenizer_fingerprint(spec: Any, run: RunSettings, backend: str = "hf") -> tuple[Any, ...]:
    if backend == "llamacpp":  # the GGUF's own token list: llama.cpp tokenizes with it
        from layerprune.evaluate.llamacpp_lm import gguf_vocabulary

        return gguf_vocabulary(spec)
    tokenizer = load_tokenizer(resolve_model(spec, run), run)
    vocab = tokenizer.get_vocab()
    return len(vocab), tuple(sorted(vocab.items()))


def warn_tokenizer_mismatch(roles: dict[str, Any], run: RunSettings, backend: str = "hf") -> str | None:
    """A baseline whose tokenizer differs from the pruned model's makes the comparison doubtful: warn, go on."""
    if "baseline" not in roles or "pruned" not in roles:
        return None
    if tokenizer_fingerprint(roles["baseline"], run, backend) == tokenizer_fingerprint(roles["pruned"], run, backend):
        return None
    message = (f"warning: the baseline {roles['baseline']} has a different tokenizer than the pruned model "
               f"{roles['pruned']}; scores are compared anyway")
    log.warning(message)
    return message


def evaluate_models(roles: dict[str, Any], settings: EvalSettings, run: RunSettings, output: Path,
                    overwrite: bool = False) -> str:
    """Evaluate each model into output/<role> (or output itself for one model); return the printed tables."""
    check_output_dir(output, overwrite, input_paths(list(roles.values())))
    warning = warn_tokenizer_mismatch(roles, run, settings.backend)
    summaries: dict[str, Summary] = {}
    pruned = roles.get("pruned")
    if pruned is not None:  # refuse an overlap before any model is evaluated
        calibration_overlap(plan_tasks(settings, resolve_data_dir(settings.data_dir))[0], settings,
                            resolve_data_dir(settings.data_dir), pruned)
    with atomic_output_dir(output, overwrite) as tmp:
        for role, spec in roles.items():
            target = tmp if len(roles) == 1 else tmp / role
            log.info("== %s: %s", role, spec or "embedded")
            summaries[role] = evaluate_model(spec, settings, run, target, overwrite=True, calibration_from=pruned)
        if len(roles) == 1:
            return format_table(next(iter(summaries.values())))
        report = compare(summaries, tmp, folders={role: tmp / role for role in summaries})
        if warning:
            (tmp / "comparison.md").write_text((tmp / "comparison.md").read_text() + f"\n{warning}\n")
    return "\n\n".join(f"## {role}\n{format_table(s)}" for role, s in summaries.items()) + "\n\n" + report["table"]
