"""Layer collapse after LaCo (Yang et al. 2024, arXiv 2402.11187): fold each dropped span into the kept block before
it, and keep the fold only while the model's last-layer representations stay close to the source's.

LaCo's Reserving-Differences-while-Seeking-Common (RDSC) merge of layer l and the m layers after it is

    theta* = theta_l + sum_{k=1..m} (theta_{l+k} - theta_l)

on the attention and MLP parameters; the layer norms stay layer l's. Here l is the kept block p = s - 1 before a
contiguous dropped span s..e, every theta is the source (teacher) model's, and the merged values are written into the
pruned model's copy of p (architecture and block count unchanged). A parameter counts as attention or MLP when it
lies outside every normalisation module of the block (class name containing "Norm"): q/k/v/o and gate/up/down with
their biases where present; input, post-attention, pre/post-feedforward and in-attention q/k norms are left as they
are. `weight` w scales the sum (theta_l + w * sum ...): not part of LaCo; w = 1 is LaCo's RDSC.

LaCo's check: after a span's merge, the average over calibration sequences of the cosine similarity between the
merged model's and the source's last hidden states (each sequence's states flattened into one vector) must exceed
the threshold T (s > T, as in the paper and its code); otherwise the merge is undone and that span stays a plain drop.

What differs from the paper: LaCo searches for the layers to merge itself (top-down from layer H to L, C layers at once,
at least I layers between merges). Here the prune stage has chosen the spans; each is merged and checked in turn, from
the highest span down as LaCo goes, on a model in which the spans not yet merged (below) are already dropped, not still
present. A merge the check refuses leaves its span dropped (LaCo, which chose the span itself, would keep the layers
instead), since the prune has already cut it. The calibration text is the teacher's answers to the training prompts
(LaCo: a handful of Wikipedia sentences). The paper's equation sums differences from the unchanged theta_l; its released
notebooks update theta_l in place inside the sum (which leaves layer l+m's values): this module follows the equation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.recover.replace import Run, decoder_layers, dropped_runs

log = logging.getLogger(__name__)
LACO_THRESHOLD = 0.65  # LaCo's T for Llama2-7B


def merge_runs(dropped: list[int], num_blocks_before: int) -> list[Run]:
    """The contiguous dropped spans with the kept block each merges into (a span at block 0 has none)."""
    if dropped and min(dropped) == 0:
        raise LayerpruneError("merge cannot fold a span that starts at block 0: no kept block before it to merge into")
    return dropped_runs(dropped, num_blocks_before)


def span_weights(runs: list[Run], weight: float, weights: list[float] | None) -> list[float]:
    """One weight per span: merge.span_weights when given (one per span, else an error), otherwise merge.weight."""
    if weights is None:
        return [weight] * len(runs)
    if len(weights) != len(runs):
        spans = ", ".join(f"{r.first}-{r.last}" for r in runs)
        raise LayerpruneError(f"merge.span_weights lists {len(weights)} weights for {len(runs)} dropped spans "
                              f"({spans})")
    return list(weights)


def rdsc(anchor: Mapping[str, torch.Tensor], span: Sequence[Mapping[str, torch.Tensor]], names: Iterable[str],
         weight: float = 1.0) -> dict[str, torch.Tensor]:
    """LaCo's RDSC merge of the named parameters: anchor + weight * sum over the span of (block - anchor), in float64,
    returned in the anchor's dtype (names absent from `names`, such as norms, are not returned)."""
    merged = {}
    for name in names:
        base = anchor[name].detach().double()
        delta = sum((block[name].detach().double() - base for block in span), torch.zeros_like(base))
        merged[name] = (base + weight * delta).to(anchor[name].dtype)
    return merged


def merged_names(block: torch.nn.Module) -> list[str]:
    """The block's attention and MLP parameters: every parameter outside its normalisation modules."""
    norms = [f"{n}." for n, m in block.named_modules() if n and "norm" in type(m).__name__.lower()]
    return [n for n, _ in block.named_parameters() if not any(n.startswith(prefix) for prefix in norms)]


def check_mergeable(teacher: Any, run: Run) -> dict[str, torch.Tensor]:
    """The anchor's source parameters; every block of the span must have the same parameter names and shapes."""
    layers = decoder_layers(teacher)
    base = dict(layers[run.first - 1].named_parameters())
    for index in range(run.first, run.last + 1):
        params = dict(layers[index].named_parameters())
        odd = sorted(set(params) ^ set(base)) or [n for n in base if params[n].shape != base[n].shape]
        if odd:
            raise LayerpruneError(f"merge needs blocks with one parameter layout: block {index} and block "
                                  f"{run.first - 1} differ in {odd[0]}")
    return base


@torch.no_grad()
def last_hidden_states(model: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The model's last-layer hidden states (after the final norm, as LaCo reads them) per sequence, float32 on CPU."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    states = [model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True,
                    use_cache=False).hidden_states[-1][0].float().cpu() for ids in sequences]
    model.train(was_training)
    return states


def mean_similarity(states: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """LaCo's Avg_Cos_Sim: per sequence the cosine of the flattened state matrices, averaged over the sequences."""
    sims = [float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))
            for a, b in zip(states, reference, strict=True)]
    return sum(sims) / len(sims)


@torch.no_grad()
def merge_blocks(student: Any, teacher: Any, dropped: list[int], sequences: list[list[int]],
                 threshold: float = LACO_THRESHOLD, weight: float = 1.0,
                 weights: list[float] | None = None) -> list[dict[str, Any]]:
    """Merge every dropped span into the student's anchor block (RDSC, highest span first) and keep each merge only if
    the mean cosine similarity of the student's last hidden states with the teacher's on `sequences` stays above
    `threshold`; return, in block order, what each merge did (its similarity, and whether it was kept)."""
    if not sequences:
        raise LayerpruneError("merge needs calibration text for LaCo's similarity check: no teacher answers left for "
                              "training prompts")
    runs = merge_runs(dropped, len(decoder_layers(teacher)))
    reference = last_hidden_states(teacher, sequences)
    current = mean_similarity(last_hidden_states(student, sequences), reference)
    fits = []
    for run, w in reversed(list(zip(runs, span_weights(runs, weight, weights), strict=True))):
        fit, undo = merge_span(student, teacher, run, w)
        similarity = mean_similarity(last_hidden_states(student, sequences), reference)
        kept = similarity > threshold
        if not kept:
            for param, value in undo:
                param.copy_(value)
        log.info("merge: blocks %d-%d into block %d (weight %g): similarity %.4f %s threshold %g, %s", run.first,
                 run.last, run.anchor, w, similarity, ">" if kept else "<=", threshold, "kept" if kept else "undone")
        fits.append({**fit, "similarity": similarity, "similarity_unmerged": current, "kept": kept})
        current = similarity if kept else current
    return fits[::-1]


def merge_span(student: Any, teacher: Any, run: Run,
               weight: float) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Write the RDSC merge of one span into the student's anchor; what it did, and each changed parameter with its
    value before (to undo it)."""
    base = check_mergeable(teacher, run)
    anchor = dict(decoder_layers(student)[run.anchor].named_parameters())
    if set(anchor) != set(base) or any(anchor[n].shape != base[n].shape for n in base):
        raise LayerpruneError(f"merge: the pruned model's block {run.anchor} does not match the source's block "
                              f"{run.first - 1}")
    layers = decoder_layers(teacher)
    span = [dict(layers[k].named_parameters()) for k in range(run.first, run.last + 1)]
    merged = rdsc(base, span, merged_names(layers[run.first - 1]), weight)
    undo = [(anchor[name], anchor[name].detach().clone()) for name in merged]
    change = 0.0
    for name, value in merged.items():
        change += float((value.double() - anchor[name].detach().double().to(value.device)).pow(2).sum())
        anchor[name].copy_(value.to(anchor[name].device, anchor[name].dtype))
    fit = {"dropped": [run.first, run.last], "anchor": run.anchor, "weight": weight, "change_norm": change ** 0.5}
    return fit, undo
