"""Cuts matched in a saving across grains: at each level k, whole blocks (the k lowest-ranked) against attention-only
or MLP-only sublayer cuts that save about as much, the yardstick of "do sublayers cost less than blocks at equal
savings". The study that compares them (pipeline/studies/grain*.py) names its cells GRAIN-kK; this module only plans
them, from a model's per-removal costs and each grain's ranking.

Matched savings: each finer grain removes the shortest prefix of its own ranking (attention sublayers only, or MLP
sublayers only, in `servable_order`: every prefix one the Nemotron-NAS layout serves) whose removed parameters (or
KV-cache bytes per token, `match: kv-cache`) come closest to the block cut's, refused in one line when even that prefix
is more than `tolerance` of the block cut's savings away. Costs are the model's own parameters (prune/target.py's
`model_sizes`: a sublayer owns its module and the norm in front of it). `match: speedup` matches the measured speed
instead: the block cut timed against the original (prefill and decode on the device it runs on, the smaller ratio, as
`--target speedup=` counts; blocks dropped as a standard checkpoint runs, sublayers as the Nemotron-NAS layout runs
them), each finer grain given the prefix whose measured speedup is nearest (`matched_speed_prefix`), its gap counted
on the speed gained (speedup - 1)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings

if TYPE_CHECKING:
    from layerprune.prune.target import ModelSizes, Removal

Speed = Callable[[list["Removal"]], float]  # a prefix's speedup over the original: measured, or the FLOP model's
PARTS = {"attention": "attn", "mlp": "mlp"}


class MatchSpec(Protocol):
    """What a matched plan is asked: the grains (block first), the levels (blocks the block cut removes), the matched
    saving and the largest relative gap allowed (a grain study's recipe is one)."""

    grains: Sequence[str]
    levels: Sequence[int]
    match: str
    tolerance: float


def cut_label(grain: str, level: int) -> str:
    """A matched cut's label: GRAIN-kK."""
    return f"{grain}-k{level}"


def quantity(cost: Any, match: str) -> int:
    """The matched quantity of a Cost: parameters, or KV-cache bytes per token."""
    return int(cost.params if match == "params" else cost.kv_bytes_per_token)


def matched_prefix(ranked: Sequence[Removal], sizes: ModelSizes, goal: int, match: str,
                   tolerance: float) -> list[Removal]:
    """The prefix of `ranked` (least important first) whose removed quantity is closest to `goal` (the shorter on a
    tie); a one-line error when its gap is above `tolerance` x goal."""
    best: list[Removal] = []
    gap = goal
    for n in range(1, len(ranked) + 1):
        got = quantity(sizes.removed(ranked[:n]), match)
        if abs(got - goal) < gap:
            best, gap = list(ranked[:n]), abs(got - goal)
        if got >= goal:
            break
    if goal <= 0 or gap > tolerance * goal:
        near = quantity(sizes.removed(best), match)
        raise LayerpruneError(f"cannot match {goal:,} {match} removed within {100 * tolerance:g}%: the nearest of "
                              f"{len(ranked)} candidates, {len(best)} removals, takes {near:,}; change levels or "
                              "tolerance")
    return best


def matched_speed_prefix(ranked: Sequence[Removal], sizes: ModelSizes, goal: float, speed: Speed,
                         tolerance: float) -> tuple[list[Removal], dict[int, float]]:
    """The timed prefix of `ranked` whose speedup (`speed`) is nearest `goal` (the shorter on a tie), and every prefix
    length timed. The search starts where the FLOP model predicts the goal, goes up while the speedup falls short or
    down while the shorter prefix still reaches it, so it times the prefixes on both sides of the goal; a noisy
    timing out of order is still compared. A one-line error when the gap, counted on the speed gained (goal - 1), is
    above `tolerance`."""
    if goal <= 1:
        raise LayerpruneError(f"the block arm measured {goal:.3f}x: no speed gained to match (raise the level)")
    timed: dict[int, float] = {}

    def at(n: int) -> float:
        if n not in timed:
            timed[n] = speed(list(ranked[:n]))
        return timed[n]

    n = next((n for n in range(1, len(ranked) + 1) if sizes.predicted(ranked[:n])["speedup"] >= goal), len(ranked))
    if at(n) >= goal:
        while n > 1 and at(n - 1) >= goal:
            n -= 1
    else:
        while at(n) < goal and n < len(ranked):
            n += 1
    best = min(timed, key=lambda c: (abs(timed[c] - goal), c))
    gap = (at(best) - goal) / (goal - 1)
    if abs(gap) > tolerance:
        raise LayerpruneError(f"cannot match the block arm's {goal:.3f}x within {100 * tolerance:g}% of its speed "
                              f"gain: the nearest of {len(ranked)} candidates, {best} removals, measured "
                              f"{at(best):.3f}x; change levels or tolerance")
    return list(ranked[:best]), timed


def plan_matched(study: MatchSpec, sizes: ModelSizes, rankings: dict[str, list[Removal]],
                 speed: Speed | None = None) -> dict[str, Any]:
    """Every cell's removals and savings: the block arm's k lowest-ranked blocks, each finer grain's matched prefix
    (`match: speedup`: matched on `speed`, the FLOP model's prediction where none is given)."""
    out: dict[str, Any] = {}
    for level in study.levels:
        blocks = rankings["block"][:level]
        if len(blocks) < level:
            raise LayerpruneError(f"level {level}: only {len(blocks)} blocks can be removed")
        if study.match == "speedup":
            out.update(_speed_cells(study, sizes, rankings, level, speed or _predicted_speed(sizes)))
            continue
        goal = quantity(sizes.removed(blocks), study.match)
        for grain in study.grains:
            chosen = blocks if grain == "block" else matched_prefix(rankings[grain], sizes, goal, study.match,
                                                                    study.tolerance)
            out[cut_label(grain, level)] = {**_savings(sizes, grain, level, chosen),
                                       "gap": (quantity(sizes.removed(chosen), study.match) - goal) / goal}
    return out


def _speed_cells(study: MatchSpec, sizes: ModelSizes, rankings: dict[str, list[Removal]], level: int,
                 speed: Speed) -> dict[str, Any]:
    blocks = rankings["block"][:level]
    goal = speed(list(blocks))
    out = {cut_label("block", level): {**_savings(sizes, "block", level, blocks), "speedup": goal, "gap": 0.0}}
    for grain in study.grains[1:]:
        chosen, timed = matched_speed_prefix(rankings[grain], sizes, goal, speed, study.tolerance)
        out[cut_label(grain, level)] = {**_savings(sizes, grain, level, chosen), "speedup": timed[len(chosen)],
                                   "gap": (timed[len(chosen)] - goal) / (goal - 1),
                                   "timed": {str(n): v for n, v in sorted(timed.items())}}
    return out


def _savings(sizes: ModelSizes, grain: str, level: int, chosen: Sequence[Removal]) -> dict[str, Any]:
    total, removed = sizes.total, sizes.removed(chosen)
    return {"grain": grain, "level": level,
            "removals": [r if isinstance(r, int) else str(r) for r in sorted(chosen, key=_order)],
            "params_removed": removed.params, "params_fraction": removed.params / total.params,
            "kv_fraction": removed.kv_bytes_per_token / max(total.kv_bytes_per_token, 1),
            "predicted_speedup": sizes.predicted(chosen)["speedup"]}


def _predicted_speed(sizes: ModelSizes) -> Speed:
    return lambda removals: float(sizes.predicted(removals)["speedup"])


def measured_speed(model_ref: str, settings: RunSettings, repeats: int) -> tuple[Speed, dict[str, Any]]:
    """The original loaded once; a prefix's speedup over it timed on `--target speedup=`'s benchmark with 32 decode
    steps (prefill and decode, the smaller ratio, alternately with the original, the fastest of `repeats`). On
    a CPU: this process's CPU seconds on one thread (other loads do not count; timed on two threads, the CPU clock
    put 24 attention sublayers at 1.12x where one thread or the wall clock gives 1.29-1.31x, most likely by counting
    the threads' spin-waits); on an accelerator: the wall clock. Returns the speed function and the benchmark as the
    plan records it."""
    import dataclasses

    import torch

    from layerprune.models import load_model
    from layerprune.models.speed import SpeedBench, measured_removal_speedup

    model = load_model(model_ref, settings).model.eval()
    cpu = model.device.type == "cpu"
    bench = SpeedBench(new_tokens=32, repeats=repeats, clock="cpu" if cpu else "wall")

    def speed(removals: list[Removal]) -> float:
        with _threads(1 if cpu else None):
            return measured_removal_speedup(model, removals, bench)["speedup"]

    return speed, {**dataclasses.asdict(bench), "device": str(model.device),
                   "threads": 1 if cpu else torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype)}


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `count` for the block (None: as they are), restored after."""
    import torch

    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _order(removal: Removal) -> tuple[int, str]:
    return (removal, "") if isinstance(removal, int) else (removal.block, removal.part)


def order_rankings(grains: Sequence[str], depth: int, protected: Sequence[int]) -> dict[str, list[Removal]]:
    """Every grain's candidates in the order a tie leaves them (later block first), each sublayer grain cut where the
    Nemotron-NAS layout stops serving its prefix (`servable_order`): the dry run's stand-in for the scores, exact in
    count wherever the blocks are alike."""
    from layerprune.models.sublayers import Sublayer
    from layerprune.prune.sublayer_scores import servable_order

    order = [b for b in reversed(range(depth)) if b not in protected]
    return {grain: list(order) if grain == "block"  # type: ignore[misc]
            else servable_order({Sublayer(b, PARTS[grain]): 0.0 for b in order}, depth)  # type: ignore[arg-type]
            for grain in grains}


def config_sizes(config: Any) -> ModelSizes:
    """Per-removal costs of a model from its transformers config, built on the meta device (no weights read)."""
    import torch
    from transformers import AutoModelForCausalLM

    from layerprune.prune.target import model_sizes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model_sizes(model, torch.bfloat16)
