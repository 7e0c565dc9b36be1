"""What to prune: a strict schema, shared by the CLI, run recipes and Python callers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import check_name

Metric = Literal["nll", "accuracy"]
Granularity = Literal["block", "attention", "mlp", "sublayer"]
INDEX = re.compile(r"^\s*-?\d+\s*$")


class PruneRecipe(BaseModel):
    """How to choose the blocks (or attention / MLP sublayers) to drop."""

    model_config = ConfigDict(extra="forbid")

    granularity: Granularity = Field(
        "block",
        description="What one removal is: a whole decoder block, an attention or an MLP sublayer, or either "
        "(sublayer: attention and MLP sublayers ranked together); --drop and --layers count these",
    )
    drop: int | None = Field(
        None, ge=1, description="Number of decoder blocks to drop (of sublayers, at a finer --granularity)"
    )
    layers: list[int | str] | None = Field(
        None,
        description="Explicit blocks to drop, comma-separated (original numbering); at a finer --granularity, "
        "sublayers named BLOCK.attn or BLOCK.mlp, e.g. 12.attn,12.mlp",
    )
    target: str | None = Field(
        None,
        description="Prune to a target instead of --drop/--layers: params=6.5B or params=0.8x (parameters left), "
        "memory=12GiB or memory=0.7x (weight bytes at the saved dtype; the KV cache is not counted), kv-cache=0.5x "
        "(KV-cache bytes per token left), speedup=1.4x (measured on this device: prefill and decode tokens/s both "
        "that much faster; at a finer --granularity, as the Nemotron-NAS layout runs the candidate); the "
        "lowest-scored blocks (sublayers at a finer --granularity) go until it is met",
    )
    outtype: str | None = Field(
        None,
        description="With --target memory=: count the weights as `layerprune export --gguf --outtype TYPE` will "
        "write them (f32, f16, bf16, q8_0: 1-D tensors F32, rows the type's block does not divide F16) instead of "
        "at the saved dtype; a k-quant (q4_k_m, q6_k, ...: llama.cpp's choice tensor by tensor) is priced by "
        "llama.cpp's quantizer from the GGUF the model was read from (whole blocks; needs llama-cpp-python)",
    )
    score: str = Field(
        "ablation",
        description="Importance score: ablation, block-influence, angular, taylor, last, random (at a finer "
        "--granularity all but taylor, each sublayer scored on its own)",
    )
    metric: Metric = Field(
        "nll", description="Ablation metric: teacher-forced NLL, or greedy exact-match accuracy on items with answers"
    )
    iterative: bool = Field(False, description="Greedy removal: re-score the remaining blocks after each drop")
    calib: str = Field(
        "auto",
        description="Calibration data: auto (GSM8K train if reachable, else arithmetic), gsm8k, arithmetic, text, "
        "a JSONL file, or a mix such as gsm8k+arithmetic",
    )
    calib_samples: int = Field(32, ge=1, description="Number of calibration items")
    calib_seq_len: int = Field(256, ge=8, description="Longest calibration sequence in tokens")
    batch_size: int = Field(8, ge=1, description="Calibration batch size")
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens generated per item for --metric accuracy (default: 8 for arithmetic, 256 otherwise)",
    )
    verify: bool = Field(
        True,
        description="Before keeping the output, check the new config matches the pruned weights and the reloaded "
        "model gives the original's logits with the blocks skipped (--no-verify skips it; its cost is in the report)",
    )
    force: bool = Field(
        False,
        description="Prune even when the config has layer-looking fields layerprune does not know how to renumber",
    )
    protect: list[int] = Field([0], description="Blocks never dropped, comma-separated; negative counts from the end")
    data_dir: Path | None = Field(None, description="Local data mirror laid out as DIR/<dataset>/<split>.jsonl")
    score_params: dict[str, Any] = Field(
        default_factory=dict,
        validate_default=True,
        description="The scores' own parameters (declared by each score in prune.scores), written as flat keys "
        "of the recipe (angular_tokens: all) and typed as flags (--angular-tokens all)",
    )

    @model_validator(mode="before")
    @classmethod
    def _gather_score_params(cls, data: Any) -> Any:
        """A score's parameters are flat keys of the recipe: gathered here, checked by the score's own schema."""
        from layerprune.prune.scores import score_parameters

        if not isinstance(data, dict):
            return data
        keys = score_parameters()
        flat = {key: value for key, value in data.items() if key in keys}
        if not flat:
            return data
        rest = {key: value for key, value in data.items() if key not in keys}
        return {**rest, "score_params": {**(rest.get("score_params") or {}), **flat}}

    @field_validator("score_params")
    @classmethod
    def _typed_score_params(cls, values: dict[str, Any]) -> dict[str, Any]:
        from layerprune.prune.scores import all_score_params, check_score_params

        return all_score_params(check_score_params(values))

    @model_serializer(mode="wrap")
    def _flat_score_params(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """Every score's parameters written back as flat keys after the recipe's own (the defaults too, unless
        exclude_defaults); include and exclude apply to them."""
        from layerprune.prune.scores import all_score_params

        data = handler(self)
        if not isinstance(data, dict):
            return data
        data.pop("score_params", None)
        params = all_score_params(self.score_params, info.mode)
        defaults = all_score_params({}, info.mode) if info.exclude_defaults else {}
        return {**data, **{key: value for key, value in params.items() if _wanted(key, info)
                           and not (key in defaults and defaults[key] == value)}}

    @field_validator("score")
    @classmethod
    def _known_score(cls, score: str) -> str:
        from layerprune.prune.scores import SCORES

        return check_name(SCORES.kind, score, SCORES.names())

    @field_validator("metric", mode="before")
    @classmethod
    def _known_metric(cls, metric: Any) -> Any:
        return check_name("metric", metric, get_args(Metric)) if isinstance(metric, str) else metric

    @field_validator("calib")
    @classmethod
    def _known_calib(cls, calib: str) -> str:
        from layerprune.prune.calib import check_calibration

        return check_calibration(calib)

    @field_validator("layers")
    @classmethod
    def _no_duplicates(cls, layers: list[int | str] | None) -> list[int | str] | None:
        if layers is not None:
            layers = [_layer_name(item) for item in layers]
            dupes = sorted({i for i in layers if layers.count(i) > 1}, key=str)
            if dupes:
                raise ValueError(f"lists block(s) {dupes} more than once")
            if not layers:
                raise ValueError("is empty")
        return layers

    @field_validator("target")
    @classmethod
    def _readable_target(cls, target: str | None) -> str | None:
        from layerprune.prune.target import parse_target

        if target is not None:
            try:
                return parse_target(target).text
            except LayerpruneError as exc:
                raise ValueError(str(exc)) from None
        return target

    @model_validator(mode="after")
    def _outtype_prices_a_memory_target(self) -> PruneRecipe:
        from layerprune.models.gguf_types import K_QUANTS, OUTTYPES

        if self.outtype is None:
            return self
        self.__dict__["outtype"] = outtype = self.outtype.lower()  # as export --outtype reads it
        if outtype not in (*OUTTYPES, *K_QUANTS):
            raise ValueError(f"unknown --outtype {outtype}: one of {', '.join((*OUTTYPES, *K_QUANTS))}")
        if outtype in K_QUANTS and self.granularity != "block":
            raise ValueError(f"--outtype {outtype} is priced by llama.cpp's quantizer, which removes whole blocks: "
                             f"at --granularity {self.granularity} count the weights at {', '.join(OUTTYPES)}")
        if self.target is None or not self.target.startswith("memory="):
            raise ValueError("--outtype prices a --target memory=...: give it with one (export --gguf writes the "
                             "file)")
        return self

    @model_validator(mode="after")
    def _drop_or_layers(self) -> PruneRecipe:
        if self.target is not None:
            if self.drop is not None or self.layers is not None:
                raise ValueError("--target chooses how many blocks to drop: give it without --drop or --layers")
            if self.iterative or (self.score == "angular" and self.granularity == "block"):
                raise ValueError("--target ranks blocks by one score each: not with --iterative or --score angular")
            return self
        if self.drop is None and self.layers is None:
            raise ValueError("give --drop N, --layers LIST or --target")
        if self.drop is not None and self.layers is not None and self.drop != len(self.layers):
            raise ValueError(f"--drop {self.drop} disagrees with --layers ({len(self.layers)} {self.unit}s)")
        return self

    @model_validator(mode="after")
    def _names_fit_granularity(self) -> PruneRecipe:
        names = [str(item) for item in self.layers or []]
        if self.granularity == "block":
            sub = [name for name in names if "." in name]
            if sub:
                raise ValueError(f"names sublayer(s) {', '.join(sub)}: add --granularity attention, mlp or sublayer")
            return self
        wrong = [name for name in names if not name.endswith(tuple(f".{part}" for part in self.parts))]
        if wrong:
            form = " or ".join(f"BLOCK.{part}" for part in self.parts)
            raise ValueError(f"at --granularity {self.granularity} name sublayers as {form}, not {', '.join(wrong)}")
        from layerprune.prune.sublayer_scores import SUBLAYER_SCORES

        if self.layers is None and self.score not in SUBLAYER_SCORES.names():
            raise ValueError(f"score '{self.score}' ranks whole blocks only; at --granularity {self.granularity} "
                             f"use {', '.join(SUBLAYER_SCORES.names())}")
        return self

    @property
    def parts(self) -> tuple[str, ...]:
        """The sublayer parts one removal may take ("attn", "mlp"); empty at block granularity."""
        return {"block": (), "attention": ("attn",), "mlp": ("mlp",), "sublayer": ("attn", "mlp")}[self.granularity]

    @property
    def unit(self) -> str:
        return "block" if self.granularity == "block" else "sublayer"

    @property
    def n_drop(self) -> int:
        return len(self.layers) if self.layers is not None else int(self.drop or 0)

    @property
    def needs_calibration(self) -> bool:
        """Whether choosing the removals reads calibration data: not for explicit --layers or a data-free score."""
        from layerprune.prune.scores import is_data_free

        return self.layers is None and not is_data_free(self.score)

    @property
    def method_name(self) -> str:
        return "explicit" if self.layers is not None else self.score

    def protected_blocks(self, depth: int) -> list[int]:
        """Protected indices normalised to 0..depth-1."""
        bad = [i for i in self.protect if not -depth <= i < depth]
        if bad:
            raise LayerpruneError(f"--protect has block index(es) {bad} outside a {depth}-block model")
        return sorted({i % depth for i in self.protect})


def _wanted(key: str, info: SerializationInfo) -> bool:
    """Is `key` in the dump that `info`'s include and exclude ask for."""
    if info.include is not None and key not in info.include:
        return False
    return not (info.exclude is not None and key in info.exclude)


def _layer_name(item: int | str) -> int | str:
    """A block index as an int, a sublayer name as `12.attn`; ValueError on anything else."""
    from layerprune.models.sublayers import PATTERN

    if isinstance(item, int) or INDEX.match(item):
        return int(item)
    match = PATTERN.match(item)
    if not match:
        raise ValueError(f"cannot read {item!r}: name a block (12) or a sublayer (12.attn, 12.mlp)")
    return f"{int(match.group(1))}.{match.group(2)}"
