"""merge as LaCo (arXiv 2402.11187): the RDSC merge on attention and MLP parameters only, against values computed by
hand, and LaCo's check of the last hidden states' cosine similarity with the teacher's against a threshold."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerprune.models import drop_blocks
from layerprune.recover import merge
from layerprune.recover.schema import RecoverRecipe
from tiny import tiny_config

LLAMA_MERGED = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def _sequences(n: int = 3, length: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 380, (length,), generator=g).tolist() for _ in range(n)]


def _pair(model_dir) -> tuple:
    teacher = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    student = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    drop_blocks(student, [2, 3, 5])
    return teacher, student


def test_rdsc_equals_a_hand_computed_merge():
    """theta_l + sum_k (theta_{l+k} - theta_l) for the named parameters only; the norm is not returned."""
    anchor = {"q": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "norm": torch.tensor([1.0, 1.0])}
    span = [{"q": torch.tensor([[2.0, 0.0], [1.0, 4.0]]), "norm": torch.tensor([5.0, 5.0])},
            {"q": torch.tensor([[0.0, 2.0], [3.0, 8.0]]), "norm": torch.tensor([7.0, 7.0])}]
    merged = merge.rdsc(anchor, span, ["q"])
    # 1 + (2 - 1) + (0 - 1) = 1; 2 + (0 - 2) + (2 - 2) = 0; 3 + (1 - 3) + (3 - 3) = 1; 4 + (4 - 4) + (8 - 4) = 8
    assert set(merged) == {"q"} and torch.equal(merged["q"], torch.tensor([[1.0, 0.0], [1.0, 8.0]]))
    half = merge.rdsc(anchor, span, ["q"], weight=0.5)  # 1 + 0.5 * 0 = 1; 2 + 0.5 * -2 = 1; 3 + 0.5 * -2 = 2; 4 + 2
    assert torch.equal(half["q"], torch.tensor([[1.0, 1.0], [2.0, 6.0]]))
    assert torch.equal(anchor["q"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # the inputs are left as they were


def test_merge_on_three_tiny_llama_blocks_writes_rdsc_and_leaves_the_norms():
    """Block k's j-th parameter is (k + 1) * (j + 1) everywhere: folding blocks 1 and 2 into block 0 gives
    (j + 1) * (1 + (2 - 1) + (3 - 1)) = 4 (j + 1) on attention and MLP, and block 0's own j + 1 on its norms."""
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", 3)).eval()
    with torch.no_grad():
        for k, layer in enumerate(teacher.model.layers):
            for j, (_, param) in enumerate(layer.named_parameters()):
                param.fill_((k + 1) * (j + 1))
    student = copy.deepcopy(teacher)
    drop_blocks(student, [1, 2])
    assert merge.merged_names(teacher.model.layers[0]) == LLAMA_MERGED
    fits = merge.merge_blocks(student, teacher, [1, 2], _sequences(), threshold=-1.0)
    assert [(f["dropped"], f["anchor"], f["kept"]) for f in fits] == [([1, 2], 0, True)]
    for j, (name, param) in enumerate(student.model.layers[0].named_parameters()):
        expected = 4.0 * (j + 1) if name in LLAMA_MERGED else float(j + 1)
        assert torch.equal(param, torch.full_like(param, expected)), name


def test_merged_names_leave_out_in_attention_and_feedforward_norms(tiny_models):
    layer = AutoModelForCausalLM.from_pretrained(tiny_models("gemma3_text", 2)).model.layers[0]
    names = merge.merged_names(layer)
    assert "self_attn.q_proj.weight" in names and "mlp.down_proj.weight" in names
    assert not [n for n in names if "norm" in n] and len(names) == len(LLAMA_MERGED)


def test_a_threshold_above_any_similarity_undoes_every_merge(tiny_llama):
    teacher, student = _pair(tiny_llama)
    before = {n: p.clone() for n, p in student.state_dict().items()}
    fits = merge.merge_blocks(student, teacher, [2, 3, 5], _sequences(), threshold=1.0)
    assert [(f["dropped"], f["kept"]) for f in fits] == [([2, 3], False), ([5, 5], False)]
    assert all(-1 <= f["similarity"] < 1 and f["change_norm"] > 0 for f in fits)
    assert all(torch.equal(p, before[n]) for n, p in student.state_dict().items())


def test_a_threshold_of_minus_one_keeps_every_merge_and_records_the_similarities(tiny_llama):
    teacher, student = _pair(tiny_llama)
    pruned = copy.deepcopy(student)
    seqs = _sequences()
    fits = merge.merge_blocks(student, teacher, [2, 3, 5], seqs, threshold=-1.0)
    assert [(f["dropped"], f["anchor"], f["kept"]) for f in fits] == [([2, 3], 1, True), ([5, 5], 2, True)]

    def similarity(model: torch.nn.Module) -> float:  # LaCo's Avg_Cos_Sim, by hand
        sims = []
        for ids in seqs:
            with torch.no_grad():
                a = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1].flatten()
                b = teacher(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1].flatten()
            sims.append(float(a @ b / (a.norm() * b.norm())))
        return sum(sims) / len(sims)

    # the highest span is merged first, on the pruned model; the lower one last, giving the final model
    assert fits[1]["similarity_unmerged"] == pytest.approx(similarity(pruned), abs=1e-5)
    assert fits[0]["similarity_unmerged"] == pytest.approx(fits[1]["similarity"], abs=1e-9)
    assert fits[0]["similarity"] == pytest.approx(similarity(student), abs=1e-5)
    assert fits[0]["similarity"] != pytest.approx(fits[0]["similarity_unmerged"], abs=1e-6)
    norms = [n for n, _ in student.model.layers[1].named_parameters() if "norm" in n]
    assert norms and all(torch.equal(student.model.layers[1].get_parameter(n), pruned.model.layers[1].get_parameter(n))
                         for n in norms)


def test_the_merge_section_names_laco_and_its_threshold():
    section = RecoverRecipe(method="merge").merge
    assert (section.threshold, section.calib_samples, section.weight) == (0.65, 5, 1.0)
    assert "LaCo" in type(section).__doc__ and "Not part of LaCo" in type(section).model_fields["weight"].description
    with pytest.raises(ValueError):
        RecoverRecipe(merge={"threshold": 1.5})
    with pytest.raises(ValueError):
        RecoverRecipe(merge={"calib_samples": 0})
