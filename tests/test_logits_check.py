"""The one logits-tolerance check of the written model's verification (whole and block-major) and of the head check."""

import pytest
import torch

from layerprune.core.errors import LayerpruneError
from layerprune.models.logits_check import (
    ATOL,
    WRITTEN_LOGITS_DIFFER,
    check_head_logits,
    check_logits_agree,
    logits_rtol,
)

WHAT = "the written model's logits differ"


def _reference() -> torch.Tensor:
    """Logits of 2 sequences x 3 positions x 5 tokens, largest |logit| 10, a 0 at [0, 0, 4]."""
    ref = torch.linspace(-3, 3, 30).reshape(2, 3, 5)
    ref[0, 0, 4] = 0.0
    ref[1, 2, 0] = -10.0
    return ref


def _off_by(delta: float) -> torch.Tensor:
    found = _reference().clone()
    found[0, 0, 4] = delta  # where the reference is 0: the difference is delta itself
    return found


def test_the_rtol_follows_the_compute_dtype_and_a_lossy_save():
    assert logits_rtol(torch.float32) == 1e-3
    assert logits_rtol(torch.bfloat16) == logits_rtol(torch.float16) == 2e-2
    assert logits_rtol(torch.float32, lossless=False) == logits_rtol(torch.bfloat16, lossless=False) == 5e-2


def test_equal_logits_agree_exactly():
    result = check_logits_agree(_reference(), _reference(), 1e-3, WHAT)
    assert result.max_abs_diff == 0.0 and result.argmax_agreement == 1.0
    assert result.reference_max_abs == 10.0 and result.tolerance == pytest.approx(1e-3 * 10 + ATOL)
    assert result.record() == {"max_abs_diff": 0.0, "tolerance": result.tolerance, "reference_max_abs": 10.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_difference_just_below_the_tolerance_passes(dtype):
    tolerance = logits_rtol(dtype) * 10 + ATOL
    result = check_logits_agree(_off_by(0.99 * tolerance), _reference(), logits_rtol(dtype), WHAT)
    assert result.max_abs_diff == pytest.approx(0.99 * tolerance) and result.tolerance == pytest.approx(tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_difference_just_above_the_tolerance_raises_one_line(dtype):
    tolerance = logits_rtol(dtype) * 10 + ATOL
    with pytest.raises(LayerpruneError) as caught:
        check_logits_agree(_off_by(1.01 * tolerance), _reference(), logits_rtol(dtype), WHAT, how="block-major",
                           then="nothing was written")
    message = str(caught.value)
    assert "\n" not in message
    assert message == f"{WHAT} (max |diff| {1.01 * tolerance:.3g} > {tolerance:.3g}, block-major); nothing was written"


def test_the_written_models_message_is_the_one_both_checks_gave():
    with pytest.raises(LayerpruneError) as caught:
        check_logits_agree(_off_by(1.0), _reference(), 1e-3, WRITTEN_LOGITS_DIFFER, then="nothing was written")
    assert str(caught.value) == ("surgery check failed: the written model's logits differ from the original with the "
                                 "blocks skipped (max |diff| 1 > 0.0101); nothing was written")


@pytest.mark.parametrize("where", ["found", "reference", "both"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_infinity_in_either_raises(where, bad):
    found, reference = _reference(), _reference()
    for name, tensor in (("found", found), ("reference", reference)):
        if where in (name, "both"):
            tensor[1, 1, 1] = bad
    with pytest.raises(LayerpruneError, match=r"logits hold NaN or infinity\); nothing was written$"):
        check_logits_agree(found, reference, 5e-2, WHAT, then="nothing was written")


def test_other_shapes_raise_instead_of_broadcasting():
    with pytest.raises(LayerpruneError, match=r"\(shapes \(1, 3, 5\) and \(2, 3, 5\)\)"):
        check_logits_agree(_reference()[:1], _reference(), 5e-2, WHAT)


def test_argmax_agreement_counts_positions_with_the_same_top_token():
    reference = _reference()
    reference[0, 0] = torch.tensor([1.0, 1.0 - 1e-3, 0.0, 0.0, 0.0])  # a near tie
    found = reference.clone()
    found[0, 0, 1] = 1.0 + 1e-3  # a new top-1 within tolerance: 1 of 6 positions moves
    result = check_logits_agree(found, reference, 5e-2, WHAT)
    assert result.argmax_agreement == pytest.approx(5 / 6)


def test_the_head_check_refuses_with_its_own_line():
    assert check_head_logits(_reference(), _off_by(1e-5), "LlamaForCausalLM") == pytest.approx(1e-5)
    with pytest.raises(LayerpruneError, match=r"^LlamaForCausalLM: the logits from its final norm and head differ "
                                              r"from its own forward \(max \|diff\| 0\.5 > 0\.0101, block-major\); "
                                              r"scores computed from them would be wrong"):
        check_head_logits(_reference(), _off_by(0.5), "LlamaForCausalLM", how="block-major")


def _logits_of(model_dir, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    return logits.clone()  # a normal tensor: the test plants an infinity in it


def test_both_checks_refuse_a_reference_with_an_infinity(tiny_llama):
    """inf - x is inf and rtol * inf + ATOL is inf: `diff <= tolerance` held, and a broken reference passed."""
    from layerprune.models.surgery import compare_reloaded_logits
    from layerprune.models.verify_blockwise import verify_block_major

    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    reference = _logits_of(tiny_llama, ids)
    assert compare_reloaded_logits(tiny_llama, ids, None, reference, torch.float32, torch.device("cpu"), 1e-3)[
        "max_abs_diff"] <= 1e-4  # the written model against its own logits passes
    reference[0, 2, 3] = float("inf")
    with pytest.raises(LayerpruneError, match=r"^surgery check failed: .*reference logits hold NaN or infinity"):
        compare_reloaded_logits(tiny_llama, ids, None, reference, torch.float32, torch.device("cpu"), 1e-3)
    with pytest.raises(LayerpruneError, match=r"^surgery check failed: .*reference logits hold NaN or infinity"):
        verify_block_major(None, tiny_llama, [], ids, None, torch.device("cpu"), torch.float32, 1e-3,
                           reference=reference)
