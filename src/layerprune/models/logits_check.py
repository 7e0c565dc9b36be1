"""The one check that two logits tensors of one model agree to rounding: after a weight-preserving change (blocks
dropped and the original run with them skipped, a save reloaded), or computed two ways (norm + head on the last
block's output against the model's own forward).

The tolerance is relative to the reference's largest |logit| plus a small floor: `rtol * max|reference| + ATOL`.
`logits_rtol` gives the rtol of a written model's check from the dtype the logits were computed in: float32 is
exact up to the order of its sums (1e-3); bfloat16/float16 compute rounds every block's output to 8 (11) mantissa
bits, and the two runs may order their sums differently (a block-major run, a device map, a fused kernel), so the
rounding error of a few dozen blocks adds up (2e-2); a save in a narrower dtype than the compute's rounds every
weight once more (5e-2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerprune.core.errors import LayerpruneError

ATOL = 1e-4
EXACT_RTOL = 1e-3
REDUCED_RTOL = 2e-2
LOSSY_RTOL = 5e-2
WRITTEN_LOGITS_DIFFER = ("surgery check failed: the written model's logits differ from the original with the blocks "
                         "skipped")


def logits_rtol(dtype: torch.dtype, lossless: bool = True) -> float:
    """The rtol of a written model's logits check: `dtype` is the compute dtype of both runs; `lossless` is False
    when the written weights were rounded to a narrower dtype than the compute's."""
    if not lossless:
        return LOSSY_RTOL
    return EXACT_RTOL if dtype == torch.float32 else REDUCED_RTOL


@dataclass(frozen=True)
class LogitsAgreement:
    """How closely two logits tensors agreed (all positions, padding included)."""

    max_abs_diff: float
    tolerance: float
    reference_max_abs: float
    argmax_agreement: float  # share of positions whose top-1 token is the same in both

    def record(self) -> dict[str, float]:
        """The fields a verification record keeps (the prune report's schema)."""
        return {"max_abs_diff": self.max_abs_diff, "tolerance": self.tolerance,
                "reference_max_abs": self.reference_max_abs}


def check_logits_agree(found: torch.Tensor, reference: torch.Tensor, rtol: float, what: str, *, how: str = "",
                       then: str = "") -> LogitsAgreement:
    """Compare `found` with `reference` (same shape; compared in float32 on `found`'s device) and raise one line
    when they differ by more than `rtol * max|reference| + ATOL` or either holds NaN or infinity.

    The message is `{what} (max |diff| D > T[, {how}])[; {then}]`: `what` says which logits differ, `how` how they
    were computed, `then` what follows from it."""
    tail = f"; {then}" if then else ""
    if found.shape != reference.shape:
        raise LayerpruneError(f"{what} (shapes {tuple(found.shape)} and {tuple(reference.shape)}){tail}")
    found = found.float()
    reference = reference.to(found.device).float()
    bad = [name for name, t in (("compared", found), ("reference", reference)) if not bool(torch.isfinite(t).all())]
    if bad:
        raise LayerpruneError(f"{what} ({' and '.join(bad)} logits hold NaN or infinity){tail}")
    diff = float((found - reference).abs().max()) if found.numel() else 0.0
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    tolerance = rtol * scale + ATOL
    if not diff <= tolerance:
        raise LayerpruneError(f"{what} (max |diff| {diff:.3g} > {tolerance:.3g}{f', {how}' if how else ''}){tail}")
    agree = float((found.argmax(-1) == reference.argmax(-1)).float().mean()) if found.numel() else 1.0
    return LogitsAgreement(diff, tolerance, scale, agree)


def check_head_logits(own: torch.Tensor, ours: torch.Tensor, model_name: str, how: str = "") -> float:
    """Refuse a model whose own forward's logits (`own`) are not norm + head on its last block's output (`ours`),
    to EXACT_RTOL: scores computed from `ours` would be wrong. Returns the max |diff|."""
    return check_logits_agree(
        ours, own, EXACT_RTOL, f"{model_name}: the logits from its final norm and head differ from its own forward",
        how=how, then="scores computed from them would be wrong, so this model is refused for this score",
    ).max_abs_diff
