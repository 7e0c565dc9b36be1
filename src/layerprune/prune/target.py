"""Prune to a target: parse `params=6.5B | memory=12GiB | kv-cache=0.5x | speedup=1.4x`, price each removal from
the model's actual parameters, and take the lowest-scored removals until the target is met.

A removal is a whole block (its index, an `int`) or one sublayer (`Sublayer(12, "attn")`). Its `Cost` is what it
takes away: parameters; weight bytes at the save dtype; KV-cache bytes per token (the K and V projections' output
widths, so GQA counts its KV heads, not its query heads); matmul FLOPs per token (2 x the block's 2-D weights; the
LM head stays and counts in the total). Sizes come from the parameters themselves: tied embeddings count once,
biases and norms count where they live, a sublayer owns its module and (Llama-style blocks) the norm in front of it.

The speedup a set of removals predicts is 1 / the share of per-token FLOPs left, or, for a speedup target, 1 / the
share of the benchmark's time left as a profile of the model timed each part (`speed_profile`): FLOPs miss what
does not scale with the weights (attention's score and cache work, the per-module overhead that dominates a small
model's decode step), so they under-predict removing attention on a CPU.
"""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from layerprune.core.errors import LayerpruneError
from layerprune.models.blocks import find_decoder_stack, text_config
from layerprune.models.gguf_types import K_QUANTS, OUTTYPES, written_bytes, zero_ffn_bytes
from layerprune.models.kquant_price import KQuantPricer
from layerprune.models.speed import (
    DEFAULT_BENCH,
    SpeedBench,
    SpeedProfile,
    measured_speedup,
    measured_sublayer_speedup,
    profile_parts,
)
from layerprune.models.sublayers import PARTS, Sublayer, sublayer_module
from layerprune.prune.report import TargetRecord

Removal = int | Sublayer
Quantity = Literal["params", "memory", "kv-cache", "speedup"]
Measure = Callable[[list[Removal]], Mapping[str, float]]

PATTERN = re.compile(r"^\s*([a-z-]+)\s*=\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
PARAM_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
BYTE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
              "tib": 2**40}
FORMS = {"params": "params=6.5B (B/M/K) or params=0.8x", "memory": "memory=12GiB (GiB/GB/MiB/MB) or memory=0.7x",
         "kv-cache": "kv-cache=0.5x", "speedup": "speedup=1.4x"}
NORMS = {"attn": "input_layernorm", "mlp": "post_attention_layernorm"}  # the norm in front of each sublayer


@dataclass(frozen=True)
class Target:
    """One parsed target: `relative` values are fractions of the original (a speedup is always relative)."""

    quantity: Quantity
    value: float
    relative: bool
    text: str

    def limit(self, before: float) -> float:
        """The most the quantity may be after pruning (params, memory, kv-cache)."""
        return self.value * before if self.relative else self.value


def parse_target(text: str) -> Target:
    """`"params=6.5B"` -> Target("params", 6.5e9, False, ...); a one-line error naming the forms otherwise."""
    match = PATTERN.match(str(text))
    if not match:
        raise LayerpruneError(f"cannot read target {text!r}: write one of {'; '.join(FORMS.values())}")
    name, number, unit = match.group(1).lower(), float(match.group(2)), match.group(3).lower()
    if name not in FORMS:
        raise LayerpruneError(f"unknown target {name!r} in {text!r}: one of {', '.join(FORMS)}")
    if unit == "x":
        if name == "speedup" and number <= 1:
            raise LayerpruneError(f"target {text!r}: a speedup must be above 1x")
        if name != "speedup" and not 0 < number < 1:
            raise LayerpruneError(f"target {text!r}: a fraction of the original must be between 0x and 1x")
        return Target(name, number, True, f"{name}={match.group(2)}x")  # type: ignore[arg-type]
    units = PARAM_UNITS if name == "params" else BYTE_UNITS if name == "memory" else {}
    if unit not in units or number <= 0:
        raise LayerpruneError(f"cannot read target {text!r}: write {FORMS[name]}")
    return Target(name, number * units[unit], False, f"{name}={match.group(2)}{match.group(3)}")  # type: ignore


@dataclass(frozen=True)
class Cost:
    """What a removal takes away (or, as a model's total, what it has)."""

    params: int = 0
    bytes: int = 0
    kv_bytes_per_token: int = 0
    flops_per_token: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(self.values(), other.values(), strict=True)))

    def __sub__(self, other: Cost) -> Cost:
        return Cost(*(a - b for a, b in zip(self.values(), other.values(), strict=True)))

    def values(self) -> tuple[int, int, int, int]:
        return self.params, self.bytes, self.kv_bytes_per_token, self.flops_per_token


@dataclass
class ModelSizes:
    """A model's totals and the cost of each possible removal: every block, every attention and MLP sublayer."""

    total: Cost
    costs: dict[Removal, Cost]
    dtype: str
    # bytes a block whose MLP alone is removed keeps in the written file (the `deci` export's zero FFN; 0 unless the
    # bytes are counted as `export --gguf --outtype` writes them)
    zero_ffn_bytes: int = 0
    # the time each removal takes in the speed benchmark (speedup targets): the speedup is predicted from it
    profile: SpeedProfile | None = None
    # the weight bytes of the model minus some blocks as llama.cpp's quantizer prices them (a k-quant --outtype:
    # models/kquant_price.py); replaces the bytes the costs add up to
    priced: Callable[[list[int]], int] | None = None

    def removed(self, removals: Iterable[Removal]) -> Cost:
        """The cost of a set of removals; a block and its own sublayers are not counted twice."""
        total = Cost()
        for key in _keys(removals):
            total += self.costs[key]
            if isinstance(key, Sublayer) and key.part == "mlp":  # the block keeps its attention
                total -= Cost(bytes=self.zero_ffn_bytes)
        return total

    def predicted(self, removals: Iterable[Removal]) -> dict[str, Any]:
        """Params, weight bytes, KV-cache bytes per token and compute share after the removals, and the speedup
        they predict: from the profile's time shares where there is one (`prefill_speedup`, `decode_speedup` and
        their smaller), else 1 / the share of per-token matmul FLOPs left; `flops_speedup` is always the latter."""
        removals = list(removals)
        after = self.total - self.removed(removals)
        flops = self.total.flops_per_token / max(after.flops_per_token, 1)
        timed = self.profile.speedup(_keys(removals)) if self.profile is not None else {"speedup": flops}
        memory = after.bytes if self.priced is None else self.priced([int(r) for r in _keys(removals)])
        return {
            "params": after.params,
            "memory_bytes": memory,
            "kv_bytes_per_token": after.kv_bytes_per_token,
            "flops_per_token": after.flops_per_token,
            "flops_speedup": flops,
            **timed,
        }


def _keys(removals: Iterable[Removal]) -> list[Removal]:
    """The removals as priced: a block whose sublayers are all removed counts once, whole."""
    parts: dict[int, set[str]] = {}
    for removal in removals:
        block, named = (removal, set(PARTS)) if isinstance(removal, int) else (removal.block, {removal.part})
        parts.setdefault(block, set()).update(named)
    keys: list[Removal] = []
    for block, named in parts.items():
        keys += [block] if named == set(PARTS) else [Sublayer(block, part) for part in sorted(named)]
    return keys


def model_sizes(model: nn.Module, dtype: torch.dtype, outtype: str | None = None,
                timed: SpeedBench | None = None) -> ModelSizes:
    """Totals and per-removal costs of `model`, weight bytes at `dtype` (the dtype it is saved in), or with `outtype`
    as `layerprune export --gguf --outtype` writes each tensor (models/gguf_types.py); with `timed`, each removal
    timed in that benchmark too (`speed_profile`), so that speedups are predicted from time."""
    stack = find_decoder_stack(model)
    width = torch.empty((), dtype=dtype).element_size()
    bytes_of = (lambda p: p.numel() * width) if outtype is None else (lambda p: written_bytes(p.shape, outtype))
    unique = {id(p): p for p in model.parameters()}
    head = stack.lm_head().weight
    costs: dict[Removal, Cost] = {}
    for index, block in enumerate(stack.layers):
        costs[index] = _cost(block.parameters(), width, _kv_elements(model, block), bytes_of)
        for part, params in _sublayer_params(block).items():
            kv = _kv_elements(model, block) if part == "attn" else 0
            costs[Sublayer(index, part)] = _cost(params, width, kv, bytes_of)
    blocks = sum((costs[i] for i in range(len(stack))), Cost())
    params = sum(p.numel() for p in unique.values())
    weights = sum(bytes_of(p) for p in unique.values())
    total = Cost(params, weights, blocks.kv_bytes_per_token, blocks.flops_per_token + 2 * head.numel())
    zero = 0 if outtype is None else zero_ffn_bytes(model.config.get_text_config().hidden_size, outtype)
    profile = None if timed is None else speed_profile(model, timed)
    return ModelSizes(total, costs, outtype or str(dtype).removeprefix("torch."), zero, profile)


def speed_profile(model: nn.Module, bench: SpeedBench = DEFAULT_BENCH) -> SpeedProfile:
    """The time each possible removal takes in `bench`: every block (the decoder layer, norms and residual adds
    in it) and every sublayer (its module and the norm in front of it), timed in one profiled run of the model."""
    parts: dict[Removal, list[nn.Module]] = {}
    for index, block in enumerate(find_decoder_stack(model).layers):
        parts[index] = [block]
        parts.update({Sublayer(index, part): modules for part, modules in _sublayer_modules(block).items()})
    return profile_parts(model, parts, bench)


def _cost(params: Iterable[nn.Parameter], width: int, kv_elements: int,
          bytes_of: Callable[[nn.Parameter], int]) -> Cost:
    params = list({id(p): p for p in params}.values())
    count = sum(p.numel() for p in params)
    flops = 2 * sum(p.numel() for p in params if p.dim() >= 2)
    return Cost(count, sum(bytes_of(p) for p in params), kv_elements * width, flops)


def _sublayer_params(block: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Each sublayer's parameters: its module's and the norm in front of it (empty when the block has no such
    sublayer, e.g. a Mamba block)."""
    return {part: [p for module in modules for p in module.parameters()]
            for part, modules in _sublayer_modules(block).items()}


def _sublayer_modules(block: nn.Module) -> dict[str, list[nn.Module]]:
    """Each sublayer's module and the norm in front of it (a part the block lacks is left out)."""
    found: dict[str, list[nn.Module]] = {}
    for part in PARTS:
        try:
            module = sublayer_module(block, part)  # type: ignore[arg-type]
        except LayerpruneError:
            continue
        norm = getattr(block, NORMS[part], None)
        found[part] = [module, *([norm] if isinstance(norm, nn.Module) else [])]
    return found


def _kv_elements(model: nn.Module, block: nn.Module) -> int:
    """K and V values one token adds to this block's cache: the K and V projections' output widths, else (fused
    projections) 2 x KV heads x head_dim from the config; 0 for a block without attention."""
    try:
        attn = sublayer_module(block, "attn")
    except LayerpruneError:
        return 0
    k, v = getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)
    if isinstance(k, nn.Linear) and isinstance(v, nn.Linear):
        return k.out_features + v.out_features
    config = text_config(model)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * heads * head_dim


@dataclass
class TargetPlan:
    """The removals chosen for a target, what they leave (predicted), and each speed measurement taken."""

    target: Target
    removals: list[Removal]
    before: dict[str, Any]
    after: dict[str, Any]
    measured: list[dict[str, Any]] = field(default_factory=list)
    weights_as: str = ""  # what the weight bytes count: the saved dtype, or the GGUF outtype

    def record(self) -> TargetRecord:
        """The report's `target` section."""
        chosen = next((m for m in self.measured if m["removals"] == len(self.removals)), None)
        return TargetRecord(target=self.target.text, removals=[str(r) for r in self.removals],
                            predicted={"before": self.before, "after": self.after}, measured_speedup=chosen,
                            measurements=self.measured, weights_as=self.weights_as or None)


def rank_removals(scores: Sequence[float | None], removals: Sequence[Removal],
                  protected: Iterable[Removal] = ()) -> list[Removal]:
    """Unprotected, scored removals, least important first; ties go to the later block first, as `--drop N` does."""
    fixed = set(protected)
    pool = [(s, _tie(r), r) for s, r in zip(scores, removals, strict=True)
            if r not in fixed and s is not None and not math.isnan(s)]
    return [r for _, _, r in sorted(pool, key=lambda t: (t[0], t[1]))]


def _tie(removal: Removal) -> tuple[int, str]:
    return (-removal, "") if isinstance(removal, int) else (-removal.block, removal.part)


def plan_to_target(
    scores: Sequence[float | None],
    removals: Sequence[Removal],
    target: Target,
    sizes: ModelSizes,
    protected: Iterable[Removal] = (),
    max_removals: int | None = None,
    measure: Measure | None = None,
) -> TargetPlan:
    """The shortest prefix of the ranking (`rank_removals`) that meets `target`; at most `max_removals` long.

    params, memory and kv-cache are computed from `sizes`. speedup is measured by `measure(removals)` (a mapping
    with a `speedup` ratio): first where the predicted speedup crosses the target, then one removal more while
    the measurement falls short, or one fewer while the shorter prefix still meets it. One line naming the best
    reachable value when even the longest allowed prefix does not meet it.
    """
    return plan_ranked(rank_removals(scores, removals, protected)[:max_removals], target, sizes, measure,
                       sublayers=not all(isinstance(r, int) for r in removals))


def plan_ranked(ranked: Sequence[Removal], target: Target, sizes: ModelSizes, measure: Measure | None = None,
                sublayers: bool = False) -> TargetPlan:
    """The shortest prefix of `ranked` (least important first) that meets `target`, as `plan_to_target` plans it;
    `sublayers` says the grain the unreachable message names (what the ranking left out)."""
    ranked = list(ranked)
    before = sizes.predicted([])
    if target.quantity == "speedup":
        if measure is None:
            raise LayerpruneError("a speedup target needs a measurement of the candidates")
        return _plan_speedup(ranked, target, sizes, measure, before, sublayers)
    key = {"params": "params", "memory": "memory_bytes", "kv-cache": "kv_bytes_per_token"}[target.quantity]
    limit = target.limit(before[key])
    counts: Iterable[int] = range(len(ranked) + 1)
    if key == "memory_bytes" and sizes.priced is not None:  # each price is a llama.cpp call: bisect the counts
        counts = [_fewest(lambda n: sizes.predicted(ranked[:n])[key] <= limit, len(ranked))]
    for count in counts:
        after = sizes.predicted(ranked[:count])
        if after[key] <= limit:
            return TargetPlan(target, ranked[:count], before, after, weights_as=sizes.dtype)
    best = sizes.predicted(ranked)[key]
    raise LayerpruneError(
        f"--target {target.text} cannot be reached: removing all {len(ranked)} removable (unprotected, scored; "
        f"{_kept(sublayers)}) leaves {_format(target.quantity, best, before[key])}"
    )


def _fewest(meets: Callable[[int], bool], most: int) -> int:
    """The smallest count in 0..most that `meets` (which holds from some count on), or `most` if none does."""
    low, high = 0, most
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if meets(middle) else (middle + 1, high)
    return low


def _kept(sublayers: bool) -> str:
    return "the first kept block keeps its attention" if sublayers else "one block kept"


def _plan_speedup(ranked: list[Removal], target: Target, sizes: ModelSizes, measure: Measure,
                  before: dict[str, Any], sublayers: bool = False) -> TargetPlan:
    measured: dict[int, dict[str, Any]] = {}

    def meets(count: int) -> bool:
        if count not in measured:
            ratios = dict(measure(ranked[:count]))
            predicted = sizes.predicted(ranked[:count])
            measured[count] = {"removals": count, "predicted": predicted["speedup"],
                               "predicted_flops": predicted["flops_speedup"], **ratios}
        return measured[count]["speedup"] >= target.value

    if not ranked:
        raise LayerpruneError(f"--target {target.text} cannot be reached: nothing is removable")
    count = next((n for n in range(1, len(ranked) + 1) if sizes.predicted(ranked[:n])["speedup"] >= target.value),
                 len(ranked))
    if meets(count):
        while count > 1 and meets(count - 1):
            count -= 1
    else:
        while not meets(count):
            if count == len(ranked):
                raise LayerpruneError(
                    f"--target {target.text} cannot be reached: removing all {count} removable (unprotected, scored; "
                    f"{_kept(sublayers)}) measured {measured[count]['speedup']:.2f}x"
                )
            count += 1
    plan = TargetPlan(target, ranked[:count], before, sizes.predicted(ranked[:count]), weights_as=sizes.dtype)
    plan.measured = [measured[n] for n in sorted(measured)]
    return plan


def _format(quantity: str, value: float, before: float) -> str:
    share = f"{value / before:.3f}x of the original" if before else ""
    if quantity == "params":
        return f"{value / 1e6:.2f}M parameters ({share})"
    if quantity == "memory":
        unit, size = ("GiB", 2**30) if value >= 2**30 else ("MiB", 2**20)
        return f"{value / size:.3f} {unit} of weights ({share})"
    return f"{value:.0f} KV-cache bytes per token ({share})"


def _basis(after: Mapping[str, Any]) -> str:
    """What the predicted speedup comes from: a timed profile (then the FLOPs' figure beside it), or FLOPs."""
    if "prefill_speedup" in after and "flops_speedup" in after:
        return (f" (timed profile: prefill {after['prefill_speedup']:.2f}x, decode {after['decode_speedup']:.2f}x; "
                f"FLOPs alone {after['flops_speedup']:.2f}x)")
    return " (from FLOPs)"


def _as(weights_as: str | None) -> str:
    if weights_as in K_QUANTS:
        return f" (as {weights_as} GGUF tensors, priced by llama.cpp's quantizer)"
    return f" (as {weights_as} GGUF tensors)" if weights_as in OUTTYPES else ""


def plan_lines(record: TargetRecord) -> list[str]:
    """The plan as printed: target, removals, predicted values before -> after, measured speedup."""
    before, after = record.predicted["before"], record.predicted["after"]
    lines = [
        f"target {record.target}: remove {', '.join(record.removals) or 'nothing'}",
        f"  predicted: parameters {before['params'] / 1e6:.2f}M -> {after['params'] / 1e6:.2f}M, weights"
        f"{_as(record.weights_as)} {before['memory_bytes'] / 2**20:.1f} MiB -> "
        f"{after['memory_bytes'] / 2**20:.1f} MiB, KV cache "
        f"{before['kv_bytes_per_token']} -> {after['kv_bytes_per_token']} bytes/token, speedup {after['speedup']:.2f}x"
        + _basis(after),
    ]
    chosen = record.measured_speedup
    if chosen:
        phases = ", ".join(f"{phase} {chosen[phase + '_speedup']:.2f}x" for phase in ("prefill", "decode")
                           if phase + "_speedup" in chosen)
        lines.append(f"  measured: speedup {chosen['speedup']:.2f}x ({phases + '; ' if phases else ''}"
                     f"predicted {chosen['predicted']:.2f}x)")
    return lines


def plan_sublayers(model: nn.Module, target: Target, order: Sequence[Sublayer], dtype: torch.dtype,
                   bench: SpeedBench = DEFAULT_BENCH, outtype: str | None = None) -> TargetPlan:
    """Sublayer removals for `target`: the shortest prefix of `order` (least important first, each prefix one the
    layout serves) that meets it, sizes from `model` (weights at `dtype`; a block losing both sublayers counts
    whole). A speedup is measured on the candidate as the Nemotron-NAS layout runs it (`measured_sublayer_speedup`:
    the DeciLM model that would be saved, sharing the kept weights) against the model whole."""

    def measure(removals: list[Removal]) -> Mapping[str, float]:
        return measured_sublayer_speedup(model, [r for r in removals if isinstance(r, Sublayer)], bench)

    speed = target.quantity == "speedup"
    return plan_ranked(order, target, model_sizes(model, dtype, outtype, bench if speed else None),
                       measure if speed else None, sublayers=True)


def plan_blocks(model: nn.Module, target: Target, scores: Sequence[float | None], protected: Sequence[int],
                dtype: torch.dtype, bench: SpeedBench = DEFAULT_BENCH, outtype: str | None = None,
                source: Path | None = None, work_root: Path | None = None) -> TargetPlan:
    """Whole-block removals for `target`: sizes from `model` (weights at `dtype`, or at `outtype` as the export
    writes them), a speedup measured on the model as it runs here (`measured_speedup`: the blocks actually dropped,
    timed against the whole model). A k-quant `outtype` is priced by llama.cpp's quantizer from `source`, the GGUF the
    model was read from (`kquant_source`), its candidate copies in a temporary folder under `work_root`."""
    depth = len(find_decoder_stack(model))
    most = max(depth - len(protected) - 1, 0)
    if outtype in K_QUANTS:
        if source is None:
            raise LayerpruneError(f"--outtype {outtype} prices a memory target from the GGUF the model was read from")
        if work_root is not None:
            work_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="layerprune-kquant-", dir=work_root) as work:
            sizes = model_sizes(model, dtype)
            sizes.priced, sizes.dtype = KQuantPricer(source, outtype, Path(work)), outtype
            return plan_to_target(scores, list(range(depth)), target, sizes, protected, most)

    def measure(removals: list[Removal]) -> Mapping[str, float]:
        if any(isinstance(r, Sublayer) for r in removals):
            raise LayerpruneError("a speedup target measures whole-block removals only")
        return measured_speedup(model, [int(r) for r in removals], bench)

    speed = target.quantity == "speedup"
    sizes = model_sizes(model, dtype, outtype, bench if speed else None)
    return plan_to_target(scores, list(range(depth)), target, sizes, protected, most, measure if speed else None)
