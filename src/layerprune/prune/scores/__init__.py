"""Importance scores: one small module each, registered by name with the parameters it reads and, where it has
one, its block-major form. Higher score = more important.

A score's parameters are flat recipe keys and `--flags` of `layerprune prune` (`--angular-tokens`), declared by the
score alone (a `ScoreParams` subclass): adding a score is its file and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

from layerprune.core.registry import Registry
from layerprune.models.blocks import DecoderStack
from layerprune.models.walker import CalibBatch
from layerprune.prune.calib import CalibSet

P = TypeVar("P", bound="ScoreParams")


class ScoreParams(BaseModel):
    """A score's own parameters (unknown keys rejected): each field a flat key of the prune recipe and a flag of
    `layerprune prune`, its description the help text; keys are unique among scores and the recipe's fields."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def of(cls: type[P], values: Mapping[str, Any]) -> P:
        """This score's parameters from a mapping of any scores' values (defaults where absent)."""
        return cls.model_validate({key: value for key, value in values.items() if key in cls.model_fields})


@dataclass
class ScoreContext:
    """Everything a score needs: the model, its blocks, calibration data and the drop request.

    `params` holds score parameters by key (`ScoreParams.of` reads a score's own, defaults where absent); a
    registered parameter also reads and writes as an attribute (`ctx.angular_tokens`), in the context's own copy
    of the dict it was given (never the recipe's recorded `score_params`)."""

    model: nn.Module
    tokenizer: Any
    stack: DecoderStack
    batches: list[CalibBatch]
    calib: CalibSet
    drop: int
    protected: list[int]
    metric: str = "nll"
    iterative: bool = False
    seed: int = 0
    batch_size: int = 8
    max_new_tokens: int = 8
    params: dict[str, Any] = field(default_factory=dict)
    progress: Callable[[str, int], Any] | None = None
    num_blocks: int | None = None  # depth without a model (scores that need only the block count)

    def __post_init__(self) -> None:
        self.params = dict(self.params)

    @property
    def depth(self) -> int:
        return self.num_blocks if self.num_blocks is not None else len(self.stack)

    def params_of(self, kind: type[P]) -> P:
        """The typed parameters of one score."""
        return kind.of(self.params)

    def __getattr__(self, name: str) -> Any:
        owner = None if name.startswith("__") else score_parameters().get(name)
        if owner is None:
            raise AttributeError(name)
        params = self.__dict__.get("params", {})
        return params[name] if name in params else owner.params.model_fields[name].get_default()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _CONTEXT_FIELDS or name not in score_parameters():
            object.__setattr__(self, name, value)
        else:
            self.params[name] = value


_CONTEXT_FIELDS = {f.name for f in fields(ScoreContext)}


@dataclass
class ScoreResult:
    """Per-block scores (original numbering; None where not scored) and the blocks chosen to drop."""

    scores: list[float | None]
    drop: list[int]
    steps: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class BlockMajorContext:
    """What a block-major score gets: the model one block at a time (models.blockwise.BlockwiseModel), the
    calibration batches, the drop request and its parameters."""

    bw: Any
    batches: list[CalibBatch]
    drop: int
    protected: list[int]
    metric: str = "nll"
    params: dict[str, Any] = field(default_factory=dict)
    progress: Callable[[str, int], Any] | None = None


@dataclass(frozen=True)
class BlockMajor:
    """A score's block-major form (prune.blockwise walks the blocks): the scorer, the hidden states it holds alive
    at once for (depth, drop), and which requests it takes (`supports(metric, iterative)`, said as `what`)."""

    score: Callable[[BlockMajorContext], ScoreResult]
    live_states: Callable[[int, int], int]
    what: str
    supports: Callable[[str, bool], bool] = lambda metric, iterative: True


ScoreFn = Callable[[ScoreContext], ScoreResult]


@dataclass(frozen=True)
class Score:
    """A registered importance score: its function, the parameters it declares, its block-major form, and whether it
    is `data_free`: it reads no calibration data and no weights, only the block count (`ctx.depth`; the model, stack
    and batches are None or empty), so a prune with it loads no data and streams the checkpoint unloaded."""

    name: str
    run: ScoreFn
    params: type[ScoreParams] = ScoreParams
    block_major: BlockMajor | None = None
    data_free: bool = False

    def __call__(self, ctx: ScoreContext) -> ScoreResult:
        return self.run(ctx)


SCORES: Registry[Score] = Registry("score")


def register_score(
    name: str, params: type[ScoreParams] = ScoreParams, block_major: BlockMajor | None = None, data_free: bool = False
) -> Callable[[ScoreFn], ScoreFn]:
    """Register a score under `name` with the parameters it reads (their keys unique among scores), its block-major
    form, and whether it reads no calibration data."""

    def add(run: ScoreFn) -> ScoreFn:
        from layerprune.prune.recipe import PruneRecipe

        taken = {*score_parameters(), *PruneRecipe.model_fields}
        clash = [key for key in params.model_fields if key in taken]
        if clash:
            raise ValueError(f"score '{name}': parameter(s) {', '.join(clash)} already declared")
        SCORES.register(name)(Score(name, run, params, block_major, data_free))
        return run

    return add


def is_data_free(name: str) -> bool:
    """Whether the named score reads no calibration data (False for a name no score has: its check comes first)."""
    return name in SCORES.names() and SCORES.get(name).data_free


def score_parameters() -> dict[str, Score]:
    """Every registered score parameter's key, and the score that declares it."""
    return {key: SCORES.get(name) for name in SCORES.names() for key in SCORES.get(name).params.model_fields}


def check_score_params(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` typed by the scores that declare them; ValueError (close names) on an unknown key or a bad value."""
    from layerprune.core.registry import check_name

    owners = score_parameters()
    for key in values:
        check_name("score parameter", key, owners)
    typed: dict[str, Any] = {}
    for score in {owners[key].name: owners[key] for key in values}.values():
        try:
            params = score.params.of(values)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise ValueError(f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None
        typed.update({key: getattr(params, key) for key in values if key in score.params.model_fields})
    return typed


def all_score_params(values: Mapping[str, Any], mode: str = "python") -> dict[str, Any]:
    """Every registered score's parameters, `values` over the defaults (what a recipe records)."""
    out: dict[str, Any] = {}
    for name in SCORES.names():
        out.update(SCORES.get(name).params.of(values).model_dump(mode=mode))
    return out


def run_importance_score(name: str, ctx: ScoreContext) -> ScoreResult:
    """Run the named importance score."""
    return SCORES.get(name)(ctx)


from layerprune.prune.scores import ablation, angular, influence, simple, taylor  # noqa: E402,F401  (registration)
