"""Training-free block replacement (the ReplaceMe / LinearPatch family), folded into a standard architecture.

For each contiguous run of dropped blocks s..e, the last kept block before it (p = s - 1) computes
h = a + c, where a is its residual stream after attention (the input of its post-attention norm) and c = r * m what
its MLP adds (m = u W_down^T; r = 1, or Granite's residual_multiplier, MiniCPM's scale_depth). The teacher's hidden
state after block e is y. One linear map T (d x d) is fitted by least squares on calibration tokens,

    T = argmin_T || c T - (y - a) ||^2  (+ ridge),

so that a + c T stands in for the whole dropped run, and folded into block p's MLP output projection:
W_down <- T^T W_down (and its bias b <- b T), which makes the block add r * m T = c T. The saved model keeps its
architecture and block count. Runs are fitted in order on the student as patched so far, so each map also absorbs
the error left by the earlier ones. The fold is exact only where the (scaled) MLP output enters the residual stream
directly (Llama, Qwen, Mistral, Phi-3, Granite...); architectures with a norm after the MLP (Gemma 2/3, OLMo 2) are
refused, and so is a block whose h - a is not a scalar times its MLP output (checked on the calibration tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.models.blocks import find_decoder_stack

log = logging.getLogger(__name__)
NORM_AFTER_MLP = ("post_feedforward_layernorm", "post_mlp_layernorm")


class _Stop(Exception):
    """Raised by a hook once the activations it needs are captured (the rest of the forward is skipped)."""


@dataclass(frozen=True)
class Run:
    """A contiguous run of dropped blocks (original numbering) and the kept block before it (student numbering)."""

    first: int
    last: int
    anchor: int  # index of the last kept block before the run, in the pruned model


def dropped_runs(dropped: list[int], num_blocks_before: int) -> list[Run]:
    """The contiguous runs of `dropped`, each with its anchor block in the pruned model."""
    drops = sorted(set(dropped))
    if not drops:
        raise LayerpruneError("replace needs dropped blocks (the pruned model's prune_report.json lists none)")
    if drops[0] == 0:
        raise LayerpruneError("replace cannot patch a run that starts at block 0 (no kept block before it to fold "
                              "into)")
    if drops[-1] >= num_blocks_before:
        raise LayerpruneError(f"dropped blocks {drops} do not fit a teacher with {num_blocks_before} blocks")
    runs, start = [], drops[0]
    for prev, cur in zip(drops, drops[1:] + [None], strict=False):
        if cur != prev + 1:
            anchor_original = start - 1
            runs.append(Run(start, prev, anchor_original - sum(d < anchor_original for d in drops)))
            start = cur
    return runs


def check_foldable(model: Any) -> None:
    layer = decoder_layers(model)[0]
    if any(hasattr(layer, name) for name in NORM_AFTER_MLP):
        raise LayerpruneError(f"replace cannot fold into {type(layer).__name__}: a norm follows its MLP, so a linear "
                              "map on the MLP output is not a linear map on the block's output")
    if not hasattr(getattr(layer, "mlp", None), "down_proj"):
        raise LayerpruneError(f"replace needs blocks with mlp.down_proj; {type(layer).__name__} has none")


def decoder_layers(model: Any) -> Any:
    return find_decoder_stack(model).layers


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


PRE_MLP_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm")  # the first the block has
SCALE_TOLERANCE = 0.25  # relative misfit of h - a = r * m above which the block is not "residual + scalar * MLP"


def pre_mlp_norm(layer: Any) -> Any:
    """The norm whose input is the residual stream after attention (a), where the block computes h = a + r * m."""
    for name in PRE_MLP_NORMS:
        if isinstance(getattr(layer, name, None), torch.nn.Module):
            return getattr(layer, name)
    raise LayerpruneError(f"replace needs the residual stream before the MLP (the input of a post-attention norm); "
                          f"{type(layer).__name__} has none of {', '.join(PRE_MLP_NORMS)}")


def capture_student(model: Any, anchor: int, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, a) at the anchor block, in float64: a, the residual stream after attention (the post-attention norm's
    input), and c = h - a, what the MLP adds to it (m, or r * m where the block scales it: Granite's
    residual_multiplier, MiniCPM's scale_depth). A block whose c is not a scalar multiple of its MLP output (a
    parallel or post-normed block) is refused: a map on m would not be the map on c that was fitted."""
    layer = decoder_layers(model)[anchor]
    seen: dict[str, torch.Tensor] = {}

    def on_norm(_module: Any, inputs: Any) -> None:
        seen["a"] = inputs[0].detach()

    def on_mlp(_module: Any, _inputs: Any, output: Any) -> None:
        seen["m"] = _first(output).detach()

    def on_layer(_module: Any, _inputs: Any, output: Any) -> None:
        seen["h"] = _first(output).detach()
        raise _Stop

    handles = [pre_mlp_norm(layer).register_forward_pre_hook(on_norm), layer.mlp.register_forward_hook(on_mlp),
               layer.register_forward_hook(on_layer)]
    try:
        model(input_ids=input_ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    a, m, h = (seen[k][0].double() for k in ("a", "m", "h"))  # upcast before the subtraction
    c = h - a
    check_scaled(c, m, type(layer).__name__)
    return c, a


def check_scaled(c: torch.Tensor, m: torch.Tensor, block: str) -> None:
    """Refuse a block whose output minus its residual is not a scalar times its MLP output."""
    scale = float((c * m).sum() / (m * m).sum().clamp(min=1e-30))
    misfit = float((c - scale * m).norm() / c.norm().clamp(min=1e-30))
    if misfit > SCALE_TOLERANCE:
        raise LayerpruneError(f"replace cannot fold into {block}: its output is not residual + scalar * MLP output "
                              f"(misfit {misfit:.2f}), so a map folded into the MLP is not the map that was fitted")


def capture_teacher(model: Any, block: int, input_ids: torch.Tensor) -> torch.Tensor:
    """The teacher's hidden state after `block`."""
    seen: dict[str, torch.Tensor] = {}

    def on_layer(_module: Any, _inputs: Any, output: Any) -> None:
        seen["y"] = _first(output).detach()
        raise _Stop

    handle = decoder_layers(model)[block].register_forward_hook(on_layer)
    try:
        model(input_ids=input_ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen["y"][0]


def solve_map(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> torch.Tensor:
    """T = (M^T M + ridge * mean(diag) * I)^-1 M^T Z, in float64."""
    damping = ridge * float(gram.diagonal().mean()) if ridge > 0 else 0.0
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.lstsq(gram + damping * eye, cross).solution


def fit_run(student: Any, teacher: Any, run: Run, sequences: list[list[int]],
            ridge: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The least-squares map of one run, and the calibration residual with the identity (plain pruning) and with T.

    Only the normal equations (C^T C, C^T Z) and ||Z||^2 are accumulated, in float64; both residuals follow from
    them (||C T - Z||^2 = tr(T^T G T) - 2 tr(T^T X) + ||Z||^2), so no token's activations are kept."""
    device = next(student.parameters()).device
    t_device = next(teacher.parameters()).device
    d = find_decoder_stack(student).config.hidden_size
    gram = torch.zeros(d, d, dtype=torch.float64)
    cross = torch.zeros(d, d, dtype=torch.float64)
    target = 0.0
    with torch.no_grad():
        for ids in sequences:
            c, a = capture_student(student, run.anchor, torch.tensor([ids], device=device))
            y = capture_teacher(teacher, run.last, torch.tensor([ids], device=t_device)).to(device).double()
            c64, z64 = c.cpu(), (y - a).cpu()
            gram += c64.T @ c64
            cross += c64.T @ z64
            target += float((z64 * z64).sum())
    t = solve_map(gram, cross, ridge)
    identity = float(gram.trace() - 2 * cross.trace()) + target
    fitted = float((t * (gram @ t)).sum() - 2 * (t * cross).sum()) + target
    return t, {"residual_identity": identity, "residual_fitted": max(fitted, 0.0),
               "tokens": sum(len(s) for s in sequences)}


def fold_map(student: Any, anchor: int, t: torch.Tensor) -> None:
    """W_down <- T^T W_down (bias b <- b T) in the anchor block: its MLP output becomes m T."""
    down = decoder_layers(student)[anchor].mlp.down_proj
    with torch.no_grad():
        t_cast = t.to(device=down.weight.device, dtype=torch.float64)
        down.weight.copy_((t_cast.T @ down.weight.double()).to(down.weight.dtype))
        if down.bias is not None:
            down.bias.copy_((down.bias.double() @ t_cast).to(down.bias.dtype))


def replace_blocks(student: Any, teacher: Any, dropped: list[int], sequences: list[list[int]],
                   ridge: float) -> list[dict[str, Any]]:
    """Fit and fold one map per dropped run, in order; return what each fit did."""
    check_foldable(student)
    runs = dropped_runs(dropped, len(decoder_layers(teacher)))
    fits = []
    for run in runs:
        t, stats = fit_run(student, teacher, run, sequences, ridge)
        fold_map(student, run.anchor, t)
        log.info("replace: blocks %d-%d folded into block %d; calibration residual %.4g -> %.4g", run.first, run.last,
                 run.anchor, stats["residual_identity"], stats["residual_fitted"])
        fits.append({"dropped": [run.first, run.last], "anchor": run.anchor, **stats})
    return fits
