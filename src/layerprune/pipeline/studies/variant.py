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
from typing import TYPE_CHECKING, Any

from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.pipeline.runner import Stage, run_stages
from layerprune.pipeline.studies.variant_grid import PosttrainVariant, VariantStudy
from layerprune.pipeline.studies.variant_report import compare, write_variant_report

if TYPE_CHECKING:
    pass


log = logging.getLogger(__name__)


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
