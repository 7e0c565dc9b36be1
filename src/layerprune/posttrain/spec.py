"""`variant:NAME` wherever a model is accepted: the variant a posttrain recipe makes (a shipped name or a YAML path),
made once and found again in the cache by its fingerprint. In a dry run a variant not yet made is planned on its
source model (the same architecture), and nothing is trained.

The spec names one model: the variant its recipe makes under the default seed (VARIANT_SEED, `layerprune variant
NAME`'s). A run's --seed, and a study's replicate seeds (the run seed + r, for the recoveries' data order and
initialisation), never reach it: every replicate prunes and recovers the same variant. A variant made under another
seed is named by its folder."""

from __future__ import annotations

import logging
from pathlib import Path

from layerprune.core.recipe_loading import build_from_recipe
from layerprune.core.settings import RunSettings
from layerprune.models.loading import PLANNING, SPEC_PREFIXES, ModelSource, resolve_model
from layerprune.posttrain.api import cached_fingerprint, fingerprint, make_variant, variant_dir
from layerprune.posttrain.schema import VariantRecipe

log = logging.getLogger(__name__)
VARIANT_SEED = 0


def resolve_variant(name: str, spec: str, settings: RunSettings) -> ModelSource:
    """The variant's cached folder (made first when missing, unless planning)."""
    recipe = build_from_recipe(VariantRecipe, "variant", name, {})
    settings = settings.model_copy(update={"seed": VARIANT_SEED})
    digest = fingerprint(recipe, settings)
    folder = variant_dir(recipe, settings, digest)
    if cached_fingerprint(folder) != digest:
        if PLANNING.get():
            source = resolve_model(recipe.model, settings)
            log.warning("%s is not made yet (layerprune variant %s); planned on its source %s", spec, name,
                        recipe.model)
            return ModelSource(spec, source.location, source.kind, {**source.identity, "variant": name,
                                                                     "variant_made": False})
        log.info("%s: making the variant first (layerprune variant %s --dry-run for its time)", spec, name)
        for other in other_seeds(recipe, folder):
            log.warning("%s: %s holds this recipe's variant made under another seed; %s names the seed-%d one "
                        "(name that one by its folder)", spec, other, spec, VARIANT_SEED)
        folder = make_variant(recipe, settings)
    return ModelSource(spec, str(folder), "local", {"path": str(folder.resolve()), "variant": recipe.name or name,
                                                    "fingerprint": digest})


SPEC_PREFIXES["variant"] = resolve_variant


def other_seeds(recipe: VariantRecipe, folder: Path) -> list[Path]:
    """The finished variants beside `folder` made from the same recipe under another seed."""
    import json

    from layerprune.models.lineage import VARIANT_REPORT

    found = []
    for other in sorted(folder.parent.glob(f"{recipe.name or recipe.method}-*")):
        try:
            report = json.loads((other / VARIANT_REPORT).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if report.get("recipe") == recipe.model_dump(mode="json") and report["settings"].get("seed") != VARIANT_SEED:
            found.append(other)
    return found
