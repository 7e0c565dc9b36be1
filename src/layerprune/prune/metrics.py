"""The math of block importance, as small pure functions over tensors and lists."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch


def token_cosine(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of two [batch, seq, hidden] states at the unmasked tokens (a flat vector)."""
    keep = mask.bool().to(a.device)
    return torch.nn.functional.cosine_similarity(a[keep].float(), b.to(a.device)[keep].float(), dim=-1)


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """A mask keeping only each row's last real token (right or left padding)."""
    last = mask.shape[1] - 1 - mask.flip(1).to(torch.int64).argmax(dim=1)
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0], device=mask.device), last] = 1
    return out * mask


def block_influence(h_in: torch.Tensor, h_out: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Sum over tokens of 1 - cos(input, output) of a block, and the token count (ShortGPT's BI)."""
    cos = token_cosine(h_in, h_out, mask)
    return float((1.0 - cos).sum()), int(cos.numel())


def angular_distance(h_a: torch.Tensor, h_b: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Sum over tokens of arccos(cos(h_a, h_b)) / pi, and the token count (Gromov et al.)."""
    cos = token_cosine(h_a, h_b, mask).clamp(-1.0, 1.0)
    return float((torch.arccos(cos) / math.pi).sum()), int(cos.numel())


def update_influence(x: torch.Tensor, update: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """Block influence of a sublayer adding `update` to the residual stream `x`: sum of 1 - cos(x, x + update)."""
    return block_influence(x, x + update, mask)


def kv_cache_kept(depth: int, attention_removed: int) -> float:
    """The fraction of the KV cache left: kept attention sublayers over all of them."""
    return (depth - attention_removed) / depth


def taylor_importance(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """First-order Taylor importance: sum of |gradient x weight| over a block's parameters."""
    with torch.no_grad():
        return float(sum((grad.float() * weight.float()).abs().sum() for grad, weight in pairs))


def accumulate(total: list[float], value: tuple[float, int]) -> None:
    """Add a (sum, count) pair to a running [sum, count] total, in place (`mean(*total)` reads it)."""
    total[0] += value[0]
    total[1] += value[1]


def mean(total: float, count: int) -> float:
    return total / count if count else float("nan")


def select_lowest(scores: Sequence[float | None], n: int, protected: Iterable[int]) -> list[int]:
    """The `n` unprotected blocks with the lowest scores (ties broken by later block first)."""
    fixed = set(protected)
    pool = [(s, -i, i) for i, s in enumerate(scores) if i not in fixed and s is not None and not math.isnan(s)]
    return sorted(i for _, _, i in sorted(pool)[:n])


def best_contiguous_run(distances: Sequence[float | None], n: int, protected: Iterable[int]) -> list[int]:
    """Start l minimising d(l, l+n) among runs [l, l+n) holding no protected block."""
    fixed = set(protected)
    starts = [s for s, d in enumerate(distances) if d is not None and not fixed & set(range(s, s + n))]
    if not starts:
        return []
    best = min(starts, key=lambda s: (distances[s], -s))
    return list(range(best, best + n))
