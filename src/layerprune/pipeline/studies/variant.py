"""`layerprune variant-study RECIPE`: post-train a variant of a model, then compare the importance profiles of the
original and the variant (Spearman of the drops, Jaccard of the critical sets, with bootstrap intervals over the
shared items). The study's claim in small: do critical blocks stay critical?

The verdict has teeth: the agreement is read against the split-half reliability ceiling (each model against itself on
disjoint halves of the items), the variant must have moved its target score, and a positive control (the original
with a critical block dropped, compared on the remaining blocks) must fall below the bar the variant passes.

Stages (pipeline/runner.py), each reusing what it finds when it was made by the same recipe and settings: variant
(variant/: recover, the unpruned model learning from its own answers; or a posttrain variant recipe, made once in the
cache), importance (importance/: analyze importance on [original, variant]), with `nmi`: nmi (nmi-original/ and
nmi-variant/: analyze nmi on each, its critical blocks the importance report's on the target task), with a control:
control (control-b<N>/, the original without block N, and importance-control-b<N>/), then report (variant.json,
variant.md, always redrawn). With `variant_seeds` of two or more, the posttrain variant is made under each seed
(variant-seed<N>, each from the cache when made) and scored on the same items (importance-seed<N>: importance/ for
the first seed, importance-seed<N>/ for the others), and the report takes the makes as one variant
(pipeline/studies/variant_seeds.py): the make-to-make SD of its scores, intervals that draw the makes, then the items.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune.analyze.schemas import ImportanceAnalysis, NmiAnalysis
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import build_from_recipe, merge_layers, validation_message
from layerprune.core.settings import RunSettings
from layerprune.pipeline.recipe import RecoverStage
from layerprune.pipeline.runner import Stage, run_stages
from layerprune.posttrain.schema import VariantRecipe
from layerprune.posttrain.spec import VARIANT_SEED

if TYPE_CHECKING:
    import numpy as np

    from layerprune.core.paired import Score

log = logging.getLogger(__name__)
STUDY_OWNED = ("models", "output", "overwrite", "dry_run", "tokenizers")  # importance fields the study sets itself
NMI_OWNED = ("model", "output", "overwrite", "critical_from", "critical_task")  # and its nmi fields


class PosttrainVariant(BaseModel):
    """The variant made by a posttrain recipe (sft, rft, grpo, distill) from the study's model."""

    model_config = ConfigDict(extra="forbid")

    posttrain: str = Field(description="Variant recipe: a shipped name (layerprune recipes list --kind variant) or a "
                                       "YAML path; its model is replaced by the study's")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Variant-recipe fields to change (nested by "
                                                                        "section)")

    def resolve(self, model: str) -> VariantRecipe:
        return build_from_recipe(VariantRecipe, "variant", self.posttrain, merge_layers(self.overrides,
                                                                                          {"model": model}))


class ControlSpec(BaseModel):
    """The positive control: a model whose critical blocks must differ, so that the comparison can fail."""

    model_config = ConfigDict(extra="forbid")

    skip_block: Literal["critical", "critical-alive"] | int = Field(
        "critical", description="The original's block dropped to make the control (compared with the original on "
        "the remaining blocks): 'critical' (the largest drop on the target task), 'critical-alive' (the largest "
        "drop among the blocks whose removal leaves the original above the analysis's min_base_score on every "
        "task, so the control has drops to compare) or a block index")


class VariantStudy(BaseModel):
    """Original vs its post-trained variant: the same importance analysis on both, compared block by block."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Study name (default output: runs/<name>)")
    description: str = Field("", description="What this study shows")
    model: str = Field("embedded", description="The original model: hub id, local directory, .gguf or embedded[:NAME]")
    variant: RecoverStage | PosttrainVariant = Field(
        description="How the variant is made: {recipe, overrides}, a recover recipe run on the unpruned model with "
        "itself as the teacher; or {posttrain, overrides}, a posttrain variant recipe")
    variant_seeds: list[int] = Field(
        default_factory=lambda: [VARIANT_SEED], min_length=1,
        description="Seeds the posttrain variant is made under, each made once (cached) and scored on the same "
        "items: the report gives the make-to-make SD of the variant's scores, and with two or more the verdict's "
        "intervals resample the seeds, then the items (default: the one seed `variant:NAME` names)")
    importance: dict[str, Any] = Field(default_factory=dict, description="`analyze importance` fields (tasks, "
                                                                         "metric, samples, ...) used for both models")
    resamples: int = Field(1000, ge=100, description="Bootstrap resamples of the items for the agreement intervals")
    alpha: float = Field(0.05, gt=0, lt=1, description="The intervals are (1 - alpha) percentile intervals")
    target: str | None = Field(None, description="The task whose unablated score the variant must move (paired, "
                                                 "on the importance items) for the verdict to be 'invariant'")
    min_shift: float = Field(0.10, gt=0, le=1,
                             description="The least rise of the target score (0.10: 10 points), its interval above 0")
    bar: float = Field(0.9, gt=0, le=1, description="'invariant' needs agreement / ceiling at least this")
    splits: int = Field(4, ge=1, description="Random halvings of the items the split-half ceiling averages over")
    control: ControlSpec | None = Field(None, description="The positive control (none: the verdict is 'not shown')")
    nmi: dict[str, Any] | None = Field(None, description="`analyze nmi` fields (calib, samples, k, ...) run on both "
                                       "models, each with its critical blocks on the target task from the importance "
                                       "report (paper A's NMI near the critical blocks); none: not run")
    output: Path | None = Field(None, description="Study directory")

    @model_validator(mode="after")
    def _sections_are_valid(self) -> VariantStudy:
        owned = sorted(set(self.importance) & set(STUDY_OWNED))
        if owned:
            raise ValueError(f"importance sets {owned}, which the study sets itself")
        owned = sorted(set(self.nmi or {}) & set(NMI_OWNED))
        if owned:
            raise ValueError(f"nmi sets {owned}, which the study sets itself")
        try:
            config = self.importance_config(Path("<variant>"))
            if isinstance(self.variant, RecoverStage):
                self.recover_recipe()
        except ValidationError as exc:
            raise ValueError(validation_message(exc, "variant study section")) from None
        if self.nmi is not None:
            self.nmi_config("original", Path("<importance.json>"), "<task>")
        if self.target is not None and self.target not in config.tasks:
            raise ValueError(f"target {self.target!r} is not one of the importance tasks {config.tasks}")
        if isinstance(self.control, ControlSpec) and isinstance(self.control.skip_block, int) \
                and self.control.skip_block < 0:
            raise ValueError("control.skip_block must be 'critical' or a block index >= 0")
        self._check_seeds()
        return self

    def _check_seeds(self) -> None:
        if len(set(self.variant_seeds)) != len(self.variant_seeds) or min(self.variant_seeds) < 0:
            raise ValueError(f"variant_seeds must be distinct seeds >= 0, got {self.variant_seeds}")
        if isinstance(self.variant, RecoverStage) and self.variant_seeds != [VARIANT_SEED]:
            raise ValueError("variant_seeds needs a posttrain variant ({posttrain: ...}); a recover variant is made "
                             "under the run's --seed")

    def replicated(self) -> bool:
        """Whether the variant is made under several seeds (the report's intervals then resample them)."""
        return len(self.variant_seeds) > 1

    def importance_dir(self, seed: int) -> str:
        """The folder of the importance analysis of the variant made under `seed`: importance/ for the first seed
        (the one a study of one seed has), importance-seed<N>/ for the others."""
        return "importance" if seed == self.variant_seeds[0] else f"importance-seed{seed}"

    def record(self) -> dict[str, Any]:
        """The study as variant.json keeps it; variant_seeds only where it is not the default, so a study of the one
        default seed is recorded (and fingerprinted by `layerprune records`) as it was before the field."""
        default = self.variant_seeds == [VARIANT_SEED]
        return self.model_dump(mode="json", exclude={"variant_seeds"} if default else None)

    def target_task(self, tasks: list[str]) -> str:
        return self.target or tasks[0]

    def run_dir(self) -> Path:
        return self.output or Path("runs") / self.name

    def recover_recipe(self) -> Any:
        """The recover recipe that makes the variant: the original model learns from its own answers."""
        assert isinstance(self.variant, RecoverStage)
        return self.variant.resolve(self.model, self.model)

    def posttrain_recipe(self) -> VariantRecipe:
        assert isinstance(self.variant, PosttrainVariant)
        return self.variant.resolve(self.model)

    def importance_config(self, variant_dir: Path) -> ImportanceAnalysis:
        return ImportanceAnalysis.model_validate({**self.importance, "models": [self.model, str(variant_dir)]})

    def nmi_config(self, model: str, report: Path, task: str) -> NmiAnalysis:
        """`analyze nmi` on one model, its critical blocks read from the study's importance report on `task`."""
        data_dir = self.importance.get("data_dir")
        try:
            return NmiAnalysis.model_validate({**({"data_dir": data_dir} if data_dir else {}), **(self.nmi or {}),
                                               "model": model, "critical_from": str(report), "critical_task": task})
        except ValidationError as exc:
            raise ValueError(validation_message(exc, "variant study nmi section")) from None


def load_variant_study(name_or_path: str, output: Path | None = None) -> VariantStudy:
    """Read and validate a variant-study recipe (a shipped name or a YAML path); `output` replaces its directory."""
    return build_from_recipe(VariantStudy, "variant-study", name_or_path,
                             {"output": str(output)} if output is not None else {})


def make_variant(study: VariantStudy, settings: RunSettings, root: Path, seed: int | None = None) -> Path:
    """The variant's directory: a posttrain variant made under `seed` (default: the study's first variant seed) from
    the cache (made once), or root/variant made by recover."""
    from layerprune.pipeline.student import original_as_student
    from layerprune.recover.job import RecoverJob
    from layerprune.recover.report import read_recover_report
    from layerprune.recover.runner import recover_model

    data_dir = study.importance.get("data_dir")
    if isinstance(study.variant, PosttrainVariant):
        from layerprune.posttrain import make_variant as posttrain_variant

        made_under = study.variant_seeds[0] if seed is None else seed  # by default, the model variant:NAME names
        fixed = settings.model_copy(update={"seed": made_under})
        return posttrain_variant(study.posttrain_recipe(), fixed, None, Path(data_dir) if data_dir else None)
    target = root / "variant"
    recipe = study.variant.resolve(str(root / "student"), study.model)
    if (target / "recover_report.json").is_file():
        if read_recover_report(target).recipe != recipe:
            raise LayerpruneError(f"{target} was made by another variant recipe; choose another --output, or delete "
                                  "it to make the variant again")
        return target
    original_as_student(study.model, settings, root / "student")
    recover_model(recipe, RecoverJob(output=target, settings=settings, data_dir=data_dir, resume=True))
    return target


def made_alike(done: Path, config: dict[str, Any], settings: RunSettings) -> bool:
    """Whether the analysis in `done` (importance.json, nmi.json) was made by `config` and the run's seed. Paths
    inside the study's folder compare by their place in it, so a run unpacked from its records elsewhere
    (`layerprune records unpack`) is the same run."""
    import json

    if not done.is_file():
        return False
    made = json.loads(done.read_text())
    roots: set[str] = set()  # where the run was when it was made: one folder for every path inside it
    alike = _alike(made["config"], config, f"{done.parent.parent}/", roots)
    return alike and len(roots) <= 1 and made["run"]["settings"].get("seed") == settings.seed


def _alike(made: Any, now: Any, root: str, roots: set[str]) -> bool:
    if isinstance(now, dict):
        return isinstance(made, dict) and made.keys() == now.keys() and all(_alike(made[k], now[k], root, roots)
                                                                         for k in now)
    if isinstance(now, list):
        return isinstance(made, list) and len(made) == len(now) and all(_alike(a, b, root, roots)
                                                                        for a, b in zip(made, now, strict=True))
    if isinstance(now, str) and isinstance(made, str) and now.startswith(root) and len(now) > len(root):
        inside = now[len(root):]
        if made != now and not made.endswith("/" + inside):
            return False
        roots.add(made[: len(made) - len(inside)])
        return True
    return bool(made == now)


def score_models(config: ImportanceAnalysis, settings: RunSettings, target: Path) -> dict[str, Any]:
    """target/importance.json for this config and seed: read when it is there, else (re)made."""
    import json

    from layerprune.analyze.importance import analyze_importance
    from layerprune.core.outputs import atomic_output_dir

    done = target / "importance.json"
    if not made_alike(done, config.model_dump(mode="json"), settings):
        with atomic_output_dir(target, overwrite=True) as tmp:  # missing, or made with other settings: (re)made
            analyze_importance(config, settings, tmp)
    return json.loads(done.read_text())


def score_both(study: VariantStudy, settings: RunSettings, root: Path, variant: Path,
               seed: int | None = None) -> dict[str, Any]:
    """The importance report of the original and the variant made under `seed` (default: the first variant seed)."""
    folder = study.importance_dir(study.variant_seeds[0] if seed is None else seed)
    return score_models(study.importance_config(variant), settings, root / folder)


def seed_reports(study: VariantStudy, root: Path) -> dict[int, dict[str, Any]] | None:
    """Every variant seed's importance report as the study's folder keeps it, by seed; None with one seed (the
    report is importance/'s alone). For redrawing a study's report from its records."""
    import json

    if not study.replicated():
        return None
    return {s: json.loads((root / study.importance_dir(s) / "importance.json").read_text())
            for s in study.variant_seeds}


def score_nmi(study: VariantStudy, settings: RunSettings, root: Path, variant: Path, report: dict[str, Any]
              ) -> dict[str, dict[str, Any]]:
    """nmi-original/ and nmi-variant/: NMI over depth of each model, with its critical blocks on the target task from
    the importance report (each reused when it was made by the same config and seed)."""
    import json

    from layerprune.analyze.nmi import analyze_nmi
    from layerprune.core.outputs import atomic_output_dir

    task = study.target_task(list(report["tasks"]))
    out = {}
    for role, model in (("original", study.model), ("variant", str(variant))):
        config = study.nmi_config(model, root / "importance" / "importance.json", task)
        done = root / f"nmi-{role}" / "nmi.json"
        if not made_alike(done, config.model_dump(mode="json"), settings):
            with atomic_output_dir(done.parent, overwrite=True) as tmp:
                analyze_nmi(config, settings, tmp)
        out[role] = json.loads(done.read_text())
    return out


def nmi_lines(study: VariantStudy, scored: dict[str, dict[str, Any]] | None) -> list[str]:
    """Paper A's NMI near the critical blocks, per model: where the representation drifts most, and how far that is
    from the blocks the target task needs."""
    if not scored:
        return []
    first = next(iter(scored.values()))
    lines = ["", "## NMI near the critical blocks", "",
             f"`analyze nmi` on {first['config']['calib']} ({first['tokens']} tokens, k = {first['config']['k']}): "
             "NMI of each block's token clusters with the embedding layer's; the elbow is the largest one-block drop "
             f"after block 0, critical blocks are each model's on {first['config']['critical_task']} from importance/ "
             "(nmi-original/, nmi-variant/ hold the curves).", "",
             "| model | critical blocks | elbow block | elbow NMI drop | clustering noise | "
             "elbow to nearest critical | NMI after the last block |", "|---|---|---|---|---|---|---|"]
    for role, r in scored.items():
        lines.append(f"| {role} ({r['model']['label']}) | {r['critical']} | {r['elbow_block']} | "
                     f"{_fmt(r['elbow_nmi_drop'])} | {_fmt(r['clustering_noise'])} | "
                     f"{r['elbow_distance_to_critical']} blocks | {_fmt(r['nmi'][-1])} |")
    return lines


def control_block(study: VariantStudy, report: dict[str, Any]) -> int:
    """The block the control drops: the recipe's index, or the original's largest drop on the target task."""
    assert study.control is not None
    task = study.target_task(list(report["tasks"]))
    original = next(iter(report["tasks"][task].values()))
    if isinstance(study.control.skip_block, int):
        if study.control.skip_block >= original["depth"]:
            raise LayerpruneError(f"control.skip_block {study.control.skip_block} is past the original's "
                                  f"{original['depth']} blocks")
        return study.control.skip_block
    alive = alive_blocks(report) if study.control.skip_block == "critical-alive" else set(range(original["depth"]))
    drops = [(d, b) for b, d in enumerate(original["drops"]) if d is not None and b in alive]
    if not drops:
        raise LayerpruneError(f"the original's drops on {task} are undefined or every block's removal leaves it "
                              "below the floor: no critical block to drop for the control")
    return max(drops)[1]


def alive_blocks(report: dict[str, Any]) -> set[int]:
    """The blocks without which the original still scores at least min_base_score on every task it is defined on."""
    floor = report["config"]["min_base_score"]
    originals = [next(iter(per_model.values())) for per_model in report["tasks"].values()]
    return {b for b in range(originals[0]["depth"])
            if all(r["scores"][b] >= floor for r in originals if not r.get("undefined"))}


def make_control(study: VariantStudy, settings: RunSettings, root: Path, block: int) -> Path:
    """root/control-b<block>: the original with `block` dropped (kept when it is complete). The control names its
    block itself, so prune's default protection (block 0, often the most critical) does not apply."""
    import json

    from layerprune.prune.api import prune_model
    from layerprune.prune.recipe import PruneRecipe

    target = root / f"control-b{block}"
    done = target / "prune_report.json"
    if done.is_file() and json.loads(done.read_text()).get("dropped") == [block]:
        return target
    prune_model(study.model, PruneRecipe(layers=[block], protect=[]), settings, output=target, overwrite=True)
    return target


def score_control(study: VariantStudy, settings: RunSettings, root: Path, report: dict[str, Any]) \
        -> tuple[int, dict[str, Any]]:
    """(the dropped block, importance-control-b<block>/importance.json: the control alone on the same items)."""
    block = control_block(study, report)
    control = make_control(study, settings, root, block)
    config = ImportanceAnalysis.model_validate({**study.importance, "models": [str(control)]})
    return block, score_models(config, settings, root / f"importance-control-b{block}")


def compare(study: VariantStudy, report: dict[str, Any], seed: int, control: tuple[int, dict[str, Any]] | None = None,
            seeds: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per task: the agreement of the original's and the variant's profiles, with intervals; the agreement as a
    fraction of the split-half ceiling, the control's the same way (on the blocks it kept), and the verdict.
    `seeds`: with the variant made under two or more seeds, every seed's importance report by seed (`report` is the
    first's): the variant is then the seeds' mean, see `compare_seeds`."""
    from layerprune.analyze.agreement import per_item, score_shift

    if seeds is not None and len(seeds) > 1:
        return compare_seeds(study, seeds, seed, control)
    kind = "probability" if report["config"]["metric"] == "nll" else "mean"
    threshold = report["config"]["threshold"]
    target = study.target_task(list(report["tasks"]))
    first, second = (per_item(r, kind) for r in report["tasks"][target].values())
    shift = {"task": target, **score_shift(first, second, kind, study.resamples, study.alpha, seed)} \
        if study.target else None
    out = {}
    for task, per_model in report["tasks"].items():
        original, variant = per_model.values()
        row, draws = pair_row(study, original, variant, kind, threshold, seed)
        against = control_row(study, row, original, control, task, kind, threshold, seed)
        undefined = [f"{role}: {r['undefined']}" for role, r in (("original", original), ("variant", variant))
                     if r.get("undefined")]
        out[task] = judged(study, row, draws, against, shift, undefined)
    return {"target": shift, "control_block": control[0] if control else None, "tasks": out}


def pair_row(study: VariantStudy, original: dict[str, Any], variant: dict[str, Any], kind: Score, threshold: float,
             seed: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One original-variant pair on one task: full scores, agreement with intervals, the agreement against its
    ceiling (`relative`), and the ceiling ratio's resampled draws per measure."""
    from layerprune.analyze.agreement import per_item, profile_agreement, relative_agreement_draws

    relative, draws = relative_agreement_draws(per_item(original, kind), per_item(variant, kind), kind, threshold,
                                               study.splits, study.resamples, study.alpha, seed)
    row = {"base_scores": [original["base_score"], variant["base_score"]],
           **profile_agreement(original, variant, kind, threshold, study.resamples, study.alpha, seed),
           "relative": relative, "control": None}
    return row, draws


# the control's ratio draws per measure, and why it has no drops
Against: TypeAlias = "tuple[dict[str, np.ndarray] | None, str | None]"


def control_row(study: VariantStudy, row: dict[str, Any], original: dict[str, Any],
                control: tuple[int, dict[str, Any]] | None, task: str, kind: Score, threshold: float,
                seed: int) -> Against:
    """The control's agreement with the original on the blocks it kept, set as row["control"]; its ratio's resampled
    draws per measure and why it has no drops (None, None without a control)."""
    import numpy as np

    from layerprune.analyze.agreement import per_item, relative_agreement_draws

    if control is None:
        return None, None
    block, scored = control
    a = per_item(original, kind)
    kept = (a[0], np.delete(a[1], block, axis=0), a[2])
    result = next(iter(scored["tasks"][task].values()))
    row["control"], draws = relative_agreement_draws(kept, per_item(result, kind), kind, threshold, study.splits,
                                                     study.resamples, study.alpha, seed)
    return draws, result.get("undefined")


def judged(study: VariantStudy, row: dict[str, Any], draws: dict[str, np.ndarray], against: Against,
           shift: dict[str, Any] | None, undefined: list[str]) -> dict[str, Any]:
    """The row with its ratio comparisons (against the ceiling and, paired, the control) and its verdict."""
    from layerprune.core.paired import MEASURES_A, invariance_verdict, ratio_comparison

    control_draws, dead = against
    controls = {} if control_draws is None else \
        {m: (row["control"][m]["ratio"], control_draws[m]) for m in MEASURES_A}
    row["comparison"] = {m: ratio_comparison(row["relative"][m]["ratio"], draws[m], controls.get(m), study.alpha)
                         for m in MEASURES_A}
    row["verdict"] = invariance_verdict(shift, row["comparison"], control_draws is not None, study.min_shift,
                                        study.bar, undefined, dead)
    row["control_undefined"] = dead
    return row


def compare_seeds(study: VariantStudy, reports: dict[int, dict[str, Any]], seed: int,
                  control: tuple[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """`compare` with the variant made under several seeds, one logical model: each seed's pair as `compare` makes
    it (`seeds`, all on the same halves and item resamples), the make-to-make spread of the variant's full scores
    (`spread`), and the verdict's quantities for the seeds' mean with two-level intervals (the seeds drawn, then the
    items: `pooled_relative`), so the verdict rests on the variant's training variance too. The original and the
    control are the first seed's report's: the same model on the same items in every report."""
    from layerprune.pipeline.studies.variant_seeds import pooled_relative, score_spread

    first = reports[study.variant_seeds[0]]
    kind = "probability" if first["config"]["metric"] == "nll" else "mean"
    threshold = first["config"]["threshold"]
    target = study.target_task(list(first["tasks"]))
    shift = pooled_shift(study, target, reports, kind, seed) if study.target else None
    out = {}
    for task in first["tasks"]:
        original = _pair(first, task)[0]
        variants = {s: _pair(reports[s], task)[1] for s in study.variant_seeds}
        rows = {s: pair_row(study, original, v, kind, threshold, seed) for s, v in variants.items()}
        relative, draws = pooled_relative({s: r[0]["relative"] for s, r in rows.items()},
                                          {s: r[1] for s, r in rows.items()}, seed, study.alpha)
        spread = score_spread({s: v["base_score"] for s, v in variants.items()})
        row = {"base_scores": [original["base_score"], spread["mean"]], "spread": spread,
               "seeds": {str(s): r[0] for s, r in rows.items()}, "relative": relative, "control": None}
        against = control_row(study, row, original, control, task, kind, threshold, seed)
        undefined = [f"{role}: {r['undefined']}" for role, r in (("original", original), *(
            (f"variant (seed {s})", v) for s, v in variants.items())) if r.get("undefined")]
        out[task] = judged(study, row, draws, against, shift, undefined)
    return {"target": shift, "control_block": control[0] if control else None, "tasks": out,
            "variant_seeds": list(study.variant_seeds)}


def _pair(report: dict[str, Any], task: str) -> tuple[dict[str, Any], dict[str, Any]]:
    original, variant = report["tasks"][task].values()
    return original, variant


def pooled_shift(study: VariantStudy, task: str, reports: dict[int, dict[str, Any]], kind: Score,
                 seed: int) -> dict[str, Any]:
    """The target's full-score shift of the seeds' mean variant over the original (each seed's shift on the same
    item resamples; the interval two-level, seeds then items), with each seed's own shift."""
    import numpy as np

    from layerprune.analyze.agreement import interval, per_item, score_shift_draws
    from layerprune.core.paired import pool_replicate_draws

    original = per_item(_pair(reports[study.variant_seeds[0]], task)[0], kind)
    made = {s: score_shift_draws(original, per_item(_pair(reports[s], task)[1], kind), kind, study.resamples,
                                 study.alpha, seed) for s in study.variant_seeds}
    value, draws = pool_replicate_draws([m[0]["shift"] for m in made.values()], [m[1] for m in made.values()], seed,
                                        study.alpha)
    return {"task": task, "before": made[study.variant_seeds[0]][0]["before"],
            "after": float(np.mean([m[0]["after"] for m in made.values()])), "shift": value,
            "interval": interval(draws.tolist(), study.alpha), "seeds": {str(s): m[0] for s, m in made.items()}}


def run_variant_study(study: VariantStudy, settings: RunSettings) -> Path:
    """Every stage in order; returns variant.md."""
    from layerprune.core.extras import require_extra

    require_extra("analyze", "the variant study")  # before the variant is trained
    root = study.run_dir()
    root.mkdir(parents=True, exist_ok=True)
    run_stages(variant_stages(study, settings, root), root)
    return root / "variant.md"


def variant_stages(study: VariantStudy, settings: RunSettings, root: Path) -> list[Stage]:
    """variant, importance (with several variant seeds: variant-seed<N> for each, then importance-seed<N> for each),
    nmi (with it, on the first seed's variant), control (with one), report: none has a completion marker (each reuses
    the variants, the importance reports and the control it finds when they were made the same way); each hands the
    next its result."""
    made: dict[str, Any] = {"variants": {}, "reports": {}}
    first = study.variant_seeds[0]

    def variant(seed: int) -> None:
        made["variants"][seed] = make_variant(study, settings, root, seed)

    def importance(seed: int) -> None:
        made["reports"][seed] = score_both(study, settings, root, made["variants"][seed], seed)

    def nmi() -> None:
        made["nmi"] = score_nmi(study, settings, root, made["variants"][first], made["reports"][first])

    def control() -> None:
        made["control"] = score_control(study, settings, root, made["reports"][first])

    def report() -> None:
        result = compare(study, made["reports"][first], settings.seed, made.get("control"),
                         made["reports"] if study.replicated() else None)
        write_variant_report(study, root, made["variants"][first], {**result, "nmi": made.get("nmi")},
                             made["variants"] if study.replicated() else None)

    named = (lambda stage, s: f"{stage}-seed{s}") if study.replicated() else (lambda stage, s: stage)
    return [*(Stage(named("variant", s), None, lambda s=s: variant(s)) for s in study.variant_seeds),
            *(Stage(named("importance", s), None, lambda s=s: importance(s)) for s in study.variant_seeds),
            *([Stage("nmi", None, nmi)] if study.nmi is not None else []),
            *([Stage("control", None, control)] if study.control is not None else []), Stage("report", None, report)]


def write_variant_report(study: VariantStudy, root: Path, variant: Path, result: dict[str, Any],
                         variants: dict[int, Path] | None = None) -> None:
    """variant.json (the study, the variant's folder, with several seeds every seed's, and the comparison) and
    variant.md."""
    from layerprune.analyze.records import write_json

    dirs = {"variant_dirs": {str(s): str(p) for s, p in variants.items()}} if variants else {}
    write_json(root / "variant.json", {"study": study.record(), "variant_dir": str(variant), **dirs, **result})
    (root / "variant.md").write_text(variant_table(study, result), encoding="utf-8")


def redraw_variant_report(root: Path) -> None:
    """variant.json and variant.md drawn again from a study's records under today's statistics: its importance
    reports (every seed's), the control's, the NMI and the variants' folders as variant.json keeps them."""
    import json

    old = json.loads((root / "variant.json").read_text())
    study = VariantStudy.model_validate(old["study"])
    report = json.loads((root / "importance" / "importance.json").read_text())
    block = old.get("control_block")
    control = None if block is None else (block, json.loads(
        (root / f"importance-control-b{block}" / "importance.json").read_text()))
    result = compare(study, report, report["run"]["settings"]["seed"], control, seed_reports(study, root))
    variants = {int(s): Path(p) for s, p in old["variant_dirs"].items()} if "variant_dirs" in old else None
    write_variant_report(study, root, Path(old["variant_dir"]), {**result, "nmi": old.get("nmi")}, variants)


def _fmt(value: float | None, interval: list[float] | None = None) -> str:
    text = "n/a" if value is None else f"{value:.2f}"
    return text + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def _ratio(relative: dict[str, Any] | None, measure: str) -> str:
    if relative is None:
        return "-"
    row = relative[measure]
    return f"{_fmt(row['agreement'])} / {_fmt(row['ceiling'])} = {_fmt(row['ratio'], row['ratio_interval'])}"


def variant_table(study: VariantStudy, result: dict[str, Any]) -> str:
    tasks = result["tasks"]
    level = f"{1 - study.alpha:.0%}"
    lines = [f"# Variant study: {study.name}", "", *([study.description, ""] if study.description else []),
             f"Original `{study.model}` vs its variant. Drops per block from importance/ (heatmap: "
             f"importance/heatmap.png). Intervals: {level} paired bootstrap over the items ({study.resamples} "
             "resamples); a resample's critical set is the blocks above the threshold.", "",
             "| task | full score (original / variant) | Spearman of drops | Jaccard of critical sets | "
             "critical (original) | critical (variant) |", "|---|---|---|---|---|---|"]
    if "variant_seeds" in result:  # several makes of the variant: a row per make, then the makes side by side
        from layerprune.pipeline.studies.variant_seeds import pair_rows, seeds_lines

        lines += pair_rows(tasks) + seeds_lines(result, level)
    else:
        for task, row in tasks.items():
            base = " / ".join(_fmt(v) for v in row["base_scores"])
            lines.append(f"| {task} | {base} | {_fmt(row['spearman'], row['spearman_interval'])} | "
                         f"{_fmt(row['critical_jaccard'], row['jaccard_interval'])} | {row['critical'][0]} | "
                         f"{row['critical'][1]} |")
    return "\n".join(lines + verdict_lines(study, result) + nmi_lines(study, result.get("nmi"))) + "\n"


def verdict_lines(study: VariantStudy, result: dict[str, Any]) -> list[str]:
    shift, block = result["target"], result["control_block"]
    lines = ["", "## Verdict", "",
             f"Agreement against its ceiling, like for like at half the items: on {study.splits} random halvings, "
             "one model's profile on one half against the other's on the other half (agreement), over the geometric "
             "mean of each model's agreement with itself across the halves (ceiling, the split-half reliability; no "
             f"Spearman-Brown step-up, both are at half the items); {1 - study.alpha:.0%} interval: each half "
             "resampled within itself. The ratio is compared with the ceiling (ratio - 1) and with the positive "
             "control's ratio on the same resamples (ratio - control, paired), each with its interval; "
             f"{study.bar:g} of the ceiling is the margin. 'different': on a measure, the interval of ratio - 1 lies "
             f"wholly below {study.bar - 1:+.2f} (the ratio's below {study.bar:g}). 'invariant': on a measure it lies "
             f"wholly at or above {study.bar - 1:+.2f}, ratio - control lies above 0 (the comparison can fail), and "
             f"the target score moved by >= {100 * study.min_shift:g} points up with its interval above 0. Else "
             "'not shown' (an interval that reaches across the margin decides nothing).", ""]
    seeds = result.get("variant_seeds")
    if seeds:
        lines[-2] += (f" The variant is the mean of its {len(seeds)} makes (seeds {', '.join(map(str, seeds))}): "
                      "its ratio, target score and shift are the makes' means, and every interval of them draws the "
                      "makes, then the items (see the section above).")
    if shift is None:
        lines.append("Target: none named (the recipe's `target`), so no verdict can be 'invariant'.")
    else:
        lines.append(f"Target {shift['task']}: {_fmt(shift['before'])} -> {_fmt(shift['after'])}, shift "
                     f"{_fmt(shift['shift'], shift['interval'])} (paired, unablated models"
                     + ("; the makes' mean, seeds then items)." if seeds else ")."))
    dead = [task for task, row in result["tasks"].items() if row.get("control_undefined")]
    lines.append("Control: none." if block is None else
                 f"Control: the original with block {block} dropped (control-b{block}/), compared with the original on "
                 "the other blocks." + (f" It is below the analysis's floor on {len(dead)} of {len(result['tasks'])} "
                                        "tasks (a collapsed model, with no drops there): its ratios on those show "
                                        "nothing, and no verdict rests on them." if dead else ""))
    lines += ["", "| task | Spearman: agreement / ceiling = ratio | Jaccard: agreement / ceiling = ratio | "
              "control Spearman | control Jaccard | ratio - 1 (Spearman / Jaccard) | ratio - control (Spearman / "
              "Jaccard) | verdict |", "|---|---|---|---|---|---|---|---|"]
    for task, row in result["tasks"].items():
        verdict = row["verdict"]
        why = f" ({'; '.join(verdict['reasons'])})" if verdict["reasons"] else ""
        lines.append(f"| {task} | {_ratio(row['relative'], 'spearman')} | {_ratio(row['relative'], 'jaccard')} | "
                     f"{_ratio(row['control'], 'spearman')} | {_ratio(row['control'], 'jaccard')} | "
                     f"{_against(row, 'vs_ceiling')} | {_against(row, 'vs_control')} | **{verdict['verdict']}**{why} |")
    return lines


def _against(row: dict[str, Any], key: str) -> str:
    """'-0.22 [-0.35, -0.08] / +0.01 [-0.10, 0.12]': a paired difference of ratios per measure, with its interval."""
    cells = []
    for measure in ("spearman", "jaccard"):
        ci = (row.get("comparison") or {}).get(measure, {}).get(key)
        cells.append("-" if not ci or ci.get("value") is None else f"{ci['value']:+.2f}" + (
            "" if ci.get("low") is None else f" [{ci['low']:+.2f}, {ci['high']:+.2f}]"))
    return " / ".join(cells)


def dry_run(study: VariantStudy, settings: RunSettings) -> str:
    """The plan: how the variant is made, and the importance analysis (rendered prompts, budgets); no work."""
    from layerprune.analyze.plan import dry_run_text

    lines = [f"variant study '{study.name}' -> {study.run_dir()}", variant_plan(study, settings)]
    if study.control is not None:
        block = study.control.skip_block
        which = f"block {block}" if isinstance(block, int) else \
            f"its most critical block (the largest drop on {study.target or 'the first task'}" + \
            (", among blocks whose removal keeps it above the floor on every task)" if block == "critical-alive"
             else ")")
        lines.append(f"control: the original with {which} dropped, its importance on the same items, compared with "
                     "the original on the other blocks")
    lines.append(f"verdict: target {study.target or 'none (never invariant)'}; invariant needs a rise >= "
                 f"{100 * study.min_shift:g} points, agreement >= {study.bar:g} of the split-half ceiling "
                 f"({study.splits} halvings) and the control below it")
    if study.nmi is not None:
        config = study.nmi_config(study.model, Path("importance.json"), study.target or "the first task")
        lines.append(f"nmi: analyze nmi on both models, {config.calib} ({config.samples} texts, at least "
                     f"{config.min_tokens} tokens), k = {config.k}, {config.seeds} seeds; critical blocks from the "
                     f"importance report on {study.target or 'the first task'}")
    lines.append("importance (the variant is scored the same way; its tokenizer is the original's):")
    config = ImportanceAnalysis.model_validate({**study.importance, "models": [study.model]})
    lines.append(dry_run_text(config, settings))
    return "\n".join(lines)


def seeds_plan(study: VariantStudy, settings: RunSettings) -> str:
    """Which makes of the variant the cache holds, the time of the others, and where each is scored."""
    from layerprune.posttrain.api import cached_fingerprint, estimate_minutes, fingerprint, variant_dir

    recipe = study.posttrain_recipe()
    data_dir = study.importance.get("data_dir")
    made, missing = [], []
    for seed in study.variant_seeds:
        under = settings.model_copy(update={"seed": seed})
        digest = fingerprint(recipe, under)
        folder = variant_dir(recipe, under, digest)
        (made if cached_fingerprint(folder) == digest else missing).append(seed)
    low, high = estimate_minutes(recipe, settings, Path(data_dir) if data_dir else None)
    extra = "" if recipe.method == "sft" else "; sampling not included"
    names = ", ".join(f"importance-seed{s}/" for s in study.variant_seeds[1:])
    return (f"variant seeds {', '.join(map(str, study.variant_seeds))}: one make under each (cached by fingerprint); "
            f"made already: {', '.join(map(str, made)) or 'none'}; to make: {', '.join(map(str, missing)) or 'none'}"
            f" ({len(missing)} x {low:.0f}-{high:.0f} min = {len(missing) * low:.0f}-{len(missing) * high:.0f} min "
            f"on 2 idle CPU cores, training only{extra})\n"
            f"importance on each make, the same items: importance/ (seed {study.variant_seeds[0]}), {names} (the "
            "original's and the control's read from the cache once made); the report gives each task's score per "
            "make with their SD, and the verdict's intervals draw the makes, then the items"
            + ("\nnmi: on the first seed's make only" if study.nmi is not None else ""))


def variant_plan(study: VariantStudy, settings: RunSettings) -> str:
    """One line (recover) or the posttrain dry run: how the variant is made."""
    if isinstance(study.variant, PosttrainVariant):
        from layerprune.posttrain import dry_run as posttrain_plan

        data_dir = study.importance.get("data_dir")
        text = (f"variant: posttrain recipe '{study.variant.posttrain}' on {study.model} (made once, cached by "
                f"fingerprint)\n" + posttrain_plan(study.posttrain_recipe(), settings,
                                                   Path(data_dir) if data_dir else None))
        return text + ("\n" + seeds_plan(study, settings) if study.replicated() else "")
    recipe = study.recover_recipe()
    length = f"{recipe.train.max_steps} steps" if recipe.train.max_steps else f"{recipe.train.epochs:g} epoch(s)"
    return (f"variant: recover recipe '{study.variant.recipe}' on {study.model} (teacher: itself), method "
            f"{recipe.method}, {recipe.prompts.samples or 'all'} {recipe.prompts.source} {recipe.prompts.split} "
            f"prompts answered at temperature {recipe.generate.temperature:g} (<= {recipe.generate.max_new_tokens} "
            f"tokens), {length} of {recipe.train.batch_size} x {recipe.train.grad_accum} at lr "
            f"{recipe.train.learning_rate:g}")
