"""A shipped protocol on the user's own model (`--model X`): the recipe's model replaced, its run directory its own.

What depends on the model is the blocks a recipe removes (prune.drop, prune.layers, a sweep's ratios: a grain
study's levels too). The rule, where a recipe says it by what it sets:
- Counts a grid's model axis sets per model (paper B: 8 of Llama's 32 blocks, 7 of Qwen's 28) are a share of each
  model's blocks: where every label's count is the same share of its model's depth (a quarter), the user's model
  loses that share of its own blocks (rounded, at least 1); a sweep's or grain study's smaller counts are kept below
  it (the shipped qwen25-7b cell's ratios 1, 2, 4, 6, 7 are llama31-8b's 1, 2, 4, 6, 8 so cut). Where no one share
  fits, or a depth cannot be read, `--drop N` is asked for.
- Counts the recipe fixes for every model (a sweep's k = 1..6) are the protocol's: kept, and refused where the
  model has too few blocks for them (then `--drop N`).
- Explicit block indices (prune.layers) name blocks of the recipe's model: refused without `--drop N`.
`--drop N` sets the largest count (prune.drop) to N wherever the recipe sets one, the smaller counts kept below it.
The name, the output folder and a literal description say the model (its slug), so a shipped run directory is never
claimed for another model.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings

# the fields that count blocks (a prune target counts them by size: params=6.5B is the recipe model's, 0.8x anyone's)
DEPTH_KEYS = (("prune", "drop"), ("prune", "layers"), ("prune", "target"), ("ratios",), ("run_order",))
PROSE = ("name", "description", "output", "tag")  # a label's fields that say which cell it is, not what it does
# Blocks of the shipped protocols' own models (their public configs), read here so that a dry run needs no hub
PUBLISHED_DEPTHS = {"meta-llama/Llama-3.1-8B-Instruct": 32, "mistralai/Mistral-7B-Instruct-v0.3": 32,
                    "Qwen/Qwen2.5-7B-Instruct": 28}
PLACEHOLDER = re.compile(r"\{[\w.-]+\}")


@dataclass(frozen=True)
class Target:
    """The user's model: its spec, its slug (for names and folders) and its blocks (None where unreadable), and
    the `--drop` count when given."""

    model: str
    slug: str
    depth: int | None
    drop: int | None = None
    rule: str = ""  # how the count was chosen, for the dry run


def target_model(model: str, drop: int | None, settings: RunSettings) -> Target:
    """Resolve the user's model (a one-line error when it cannot be) and read its depth."""
    return Target(model, model_slug(model), model_depth(model, settings), drop, "--drop" if drop else "")


def model_slug(spec: str) -> str:
    """A model spec as a folder-name part: a local folder's name, else the spec with ':' and '/' made '-'
    (embedded:my-model -> embedded-my-model, Qwen/Qwen2.5-7B -> Qwen-Qwen2.5-7B)."""
    path = Path(spec).expanduser()
    text = path.resolve().name if path.is_dir() else spec
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def model_depth(spec: str | None, settings: RunSettings) -> int | None:
    """A model's decoder blocks from its config (a variant not made yet: its source's), None where unreadable; a
    spec that resolves to nothing is a one-line error."""
    if spec in PUBLISHED_DEPTHS:
        return PUBLISHED_DEPTHS[spec]
    from layerprune.models.loading import planning
    from layerprune.pipeline.plan import model_config

    with planning():  # read a config, make nothing (a variant not yet made is read on its source model)
        config, _ = model_config(spec, settings)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = getattr(text, "num_hidden_layers", None)
    return int(depth) if isinstance(depth, int) else None


def recipe_on_model(data: Mapping[str, Any], target: Target, recipe: str) -> dict[str, Any]:
    """One recipe (no grid) on the user's model: model, counts (fixed by the recipe), name and output."""
    check_model_named_once(data, recipe)
    out = fixed_counts_on(copy.deepcopy(dict(data)), target, recipe)
    out["model"] = target.model
    return with_slug(out, target, str(data.get("model") or "embedded"))


def grid_on_model(data: Mapping[str, Any], labels: list[str] | None, target: Target, settings: RunSettings,
                  recipe: str) -> tuple[dict[str, Any], str | None, Target]:
    """A grid file's mapping with its model axis collapsed to one label, the user's model (`labels`: the model
    axis's labels the user chose, None: all of them), or, without a model axis, its model replaced everywhere;
    the model axis's name; the target with the count it derived."""
    check_model_named_once(data, recipe)
    axis = model_axis(data["grid"])
    if axis is None:
        out = with_fixed_counts(data, target, recipe)
        out["model"] = target.model
        return with_slug(out, target, str(data.get("model") or "embedded")), None, target
    chosen = {label: dict(fields or {}) for label, fields in data["grid"][axis].items()
              if labels is None or label in labels}
    check_same_protocol(chosen, axis, recipe)
    label, fields = next(iter(chosen.items()))
    derived, rule = label_drop(chosen, target, settings, recipe)
    if derived is not None:  # the label's counts and any the recipe sets beside them: the derived N
        fields, target = with_drop(fields, derived), replace(target, drop=derived, rule=rule)
    fields = {**label_prose_on(fields, label, target), "model": target.model, "tag": target.slug}
    out = with_fixed_counts({**data, "grid": {**data["grid"], axis: {}}}, target, recipe)
    out["grid"][axis] = {target.slug: fields}
    out["grid"] = {name: out["grid"][name] for name in data["grid"]}  # the file's axis order
    return out, axis, target


def with_fixed_counts(data: Mapping[str, Any], target: Target, recipe: str) -> dict[str, Any]:
    """A grid file's mapping with the counts fixed at its top and in every label on the user's model."""
    out = fixed_counts_on(copy.deepcopy(dict(data)), target, recipe)
    if "grid" in out:
        out["grid"] = {name: {label: fixed_counts_on(dict(fields or {}), target, recipe)
                              for label, fields in values.items()} for name, values in out["grid"].items()}
    return out


def model_axis(grid: Mapping[str, Any]) -> str | None:
    """The grid's axis whose labels set the model (paper B's `family`), if any."""
    return next((axis for axis, values in grid.items()
                 if any("model" in (fields or {}) for fields in values.values())), None)


def check_same_protocol(chosen: Mapping[str, Mapping[str, Any]], axis: str, recipe: str) -> None:
    """The model axis's labels differ in the model and what depends on it only; else which protocol to run on the
    user's model is the user's choice (--cell)."""
    protocols = {label: {key: value for key, value in leaves(fields) if not is_model_dependent(key)}
                 for label, fields in chosen.items()}
    first = next(iter(protocols.values()))
    differ = sorted({".".join(key) for p in protocols.values() for key in set(p) | set(first)
                     if p.get(key) != first.get(key)})
    if differ:
        raise LayerpruneError(f"--model on {recipe}: its model axis '{axis}' sets {', '.join(differ)} per model "
                              f"({', '.join(chosen)}), not only the model; name the protocol to run on yours with "
                              "--cell (one of its cells)")


def is_model_dependent(key: tuple[str, ...]) -> bool:
    """A field a model label sets for its model: the model, the cell's name, output and description, a count."""
    return key[0] in ("model", *PROSE) or any(key[:len(k)] == k for k in DEPTH_KEYS)


def leaves(data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, value) of every leaf of a nested mapping (a list is one leaf)."""
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from leaves(value, (*prefix, str(key)))
        else:
            yield (*prefix, str(key)), value


def check_model_named_once(data: Mapping[str, Any], recipe: str) -> None:
    """A recipe that names its model in another field too (a teacher, a source) cannot have it replaced alone."""
    labels = [fields for values in (data.get("grid") or {}).values() for fields in values.values()
              if isinstance(fields, Mapping)]
    trees = [{key: value for key, value in data.items() if key != "grid"}, *labels]
    models = {tree["model"] for tree in trees if isinstance(tree.get("model"), str)}
    for tree in trees:
        for key, value in leaves(tree):
            if isinstance(value, str) and value in models and key[0] not in ("model", *PROSE):
                raise LayerpruneError(f"--model on {recipe}: it names its model '{value}' also at {'.'.join(key)}, "
                                      "which --model would leave behind; copy it (layerprune recipes cp) and edit")


def counts_of(fields: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    """The block-counting fields a mapping sets."""
    found = {}
    for key in DEPTH_KEYS:
        value: Any = fields
        for part in key:
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is not None:
            found[key] = value
    return found


def largest_count(counts: Mapping[tuple[str, ...], Any]) -> int:
    """The most blocks these counts remove (prune.drop, the layers named, the largest ratio or level)."""
    values = [len(v) if key == ("prune", "layers") else max(v) if isinstance(v, list) and v else v
              for key, v in counts.items()]
    return max((int(v) for v in values if isinstance(v, int)), default=0)


def with_drop(fields: dict[str, Any], drop: int) -> dict[str, Any]:
    """The counts a mapping sets, with N as the largest: prune.drop N (prune.layers and prune.target gone), ratios
    kept below N and ending at N (a run_order keeps its order of the cuts still there, the new ones after)."""
    out = copy.deepcopy(fields)
    if isinstance(out.get("prune"), Mapping) and ({"drop", "layers", "target"} & set(out["prune"])):
        prune = {key: value for key, value in out["prune"].items() if key not in ("layers", "target")}
        out["prune"] = {**prune, "drop": drop}
    if isinstance(out.get("ratios"), list):
        out["ratios"] = [k for k in out["ratios"] if isinstance(k, int) and k < drop] + [drop]
    if isinstance(out.get("run_order"), list):  # the cuts of the ratios above, wherever the ratios are set
        kept = [k for k in out["run_order"] if isinstance(k, int) and k <= drop]
        out["run_order"] = kept + ([drop] if drop not in kept else [])
    return out


def fixed_counts_on(fields: dict[str, Any], target: Target, recipe: str) -> dict[str, Any]:
    """Counts a recipe fixes for every model: kept where the model has room for them, N with --drop N."""
    counts = counts_of(fields)
    if not counts:
        return fields
    if target.drop is not None:
        return with_drop(fields, check_room(target.drop, target, recipe))
    if ("prune", "layers") in counts:
        raise LayerpruneError(f"--model on {recipe}: prune.layers names blocks of its own model; pass --drop N "
                              f"(the blocks to remove from {target.model}, chosen by the recipe's score)")
    size = counts.get(("prune", "target"))
    if size is not None and not str(size).strip().endswith("x"):
        raise LayerpruneError(f"--model on {recipe}: prune.target {size} is a size of its own model; pass --drop N "
                              f"(or copy it and give a share: params=0.75x)")
    largest = largest_count(counts)
    if target.depth is not None and largest >= target.depth:
        raise LayerpruneError(f"--model on {recipe}: {target.model} has {target.depth} blocks and the recipe "
                              f"removes up to {largest}; pass --drop N (below {target.depth})")
    return fields


def label_drop(chosen: Mapping[str, Mapping[str, Any]], target: Target, settings: RunSettings,
               recipe: str) -> tuple[int | None, str]:
    """Counts the model axis sets per model: N with --drop N, else the one share of its depth every label's model
    loses, on the user's model (and how it was chosen); None where the labels set no count."""
    if not any(counts_of(fields) for fields in chosen.values()):
        return None, target.rule
    if target.drop is None and not any(largest_count(counts_of(fields)) for fields in chosen.values()):
        for fields in chosen.values():  # a size target alone: a share is anyone's, a size is refused
            fixed_counts_on(dict(fields), target, recipe)
        return None, target.rule
    if target.drop is not None:
        return check_room(target.drop, target, recipe), target.rule
    if any(("prune", "layers") in counts_of(f) for f in chosen.values()):
        raise LayerpruneError(f"--model on {recipe}: prune.layers names blocks of each model; pass --drop N")
    drop, rule = shared_share_drop(chosen, target, settings, recipe)
    return check_room(drop, target, recipe), rule


def shared_share_drop(chosen: Mapping[str, Mapping[str, Any]], target: Target, settings: RunSettings,
                      recipe: str) -> tuple[int, str]:
    """The user's model's count: the share of its blocks each label's model loses, when they all lose the same
    (rounded, at least 1), and the rule said in words."""
    shares: dict[str, tuple[int, int]] = {}
    for label, fields in chosen.items():
        depth = model_depth(str(fields.get("model") or "embedded"), settings)
        if depth is None:
            raise LayerpruneError(f"--model on {recipe}: the blocks of {fields.get('model')} (label {label}) cannot "
                                  "be read from here, so the share it removes is unknown; pass --drop N")
        shares[label] = (largest_count(counts_of(fields)), depth)
    if len({Fraction(count, depth) for count, depth in shares.values()}) != 1:
        said = ", ".join(f"{count} of {depth}" for count, depth in shares.values())
        raise LayerpruneError(f"--model on {recipe}: its models lose no one share of their blocks ({said}); "
                              "pass --drop N")
    if target.depth is None:
        raise LayerpruneError(f"--model on {recipe}: the blocks of {target.model} cannot be read (its config), so "
                              "the recipe's share of them is unknown; pass --drop N")
    count, depth = next(iter(shares.values()))
    said = ", ".join(f"{label} {count} of {depth}" for label, (count, depth) in shares.items())
    share = Fraction(count, depth)
    return max(1, int(share * target.depth + Fraction(1, 2))), f"{share} of its blocks, as in the recipe: {said}"


def check_room(drop: int, target: Target, recipe: str) -> int:
    """A count the user's model has room for: at least 1, below its blocks (where they could be read)."""
    if drop < 1:
        raise LayerpruneError(f"--model on {recipe}: --drop must be at least 1, not {drop}")
    if target.depth is not None and drop >= target.depth:
        raise LayerpruneError(f"--model on {recipe}: {target.model} has {target.depth} blocks; it cannot lose {drop} "
                              f"(pass --drop N between 1 and {target.depth - 1})")
    return drop


def label_prose_on(fields: dict[str, Any], label: str, target: Target) -> dict[str, Any]:
    """A model label's literal name and output on the user's model: its label (or tag) replaced by the model's slug,
    else the slug appended; a literal description says whose protocol it is."""
    out = dict(fields)
    tag = str(fields.get("tag", label))
    for key in ("name", "output"):
        value = out.get(key)
        if isinstance(value, str) and not PLACEHOLDER.search(value):
            out[key] = value.replace(tag, target.slug) if tag and tag in value else f"{value}--{target.slug}"
    if isinstance(out.get("description"), str) and "{model}" not in out["description"]:
        out["description"] = f"{fields.get('name', label)}'s protocol on {target.model}."
    return out


def with_slug(data: dict[str, Any], target: Target, shipped: str) -> dict[str, Any]:
    """Name and output (wherever a grid sets them) with the model's slug appended; a literal description says the
    model it now runs on."""
    out = copy.deepcopy(data)
    places = [out] + [fields for values in (out.get("grid") or {}).values() for fields in values.values()
                      if isinstance(fields, dict)]
    for place in places:
        if isinstance(place.get("name"), str):
            place["name"] = f"{place['name']}--{target.slug}"
        if isinstance(place.get("output"), str) and "{name}" not in place["output"]:
            place["output"] = f"{place['output']}--{target.slug}"
        if isinstance(place.get("description"), str) and "{model}" not in place["description"]:
            place["description"] = f"The protocol shipped for {shipped}, on {target.model}: {place['description']}"
    return out
