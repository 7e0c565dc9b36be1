"""Peak training memory estimate (weights, gradients, optimizer states, activations) for `--dry-run`.

All arithmetic is over the model config: nothing is loaded (the parameter count comes from a meta-device model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

GB = 1e9

# bytes per trainable parameter of each optimizer's state (two AdamW moments)
EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")  # bitsandbytes optimizers
OPTIMIZER_STATE_BYTES = {"adamw_torch": None, "adamw_8bit": 2.0, "paged_adamw_8bit": 2.0, "paged_adamw_32bit": 8.0}
# What one step keeps, per token, counted with torch's saved_tensors_hooks (unique storages, parameters left out) on a
# Llama block with sdpa, float32 and bf16, LoRA (peft, all-linear) and full; `act_bytes` is the activations' dtype.
NORM_INPUT_BYTES = 4  # each sublayer's RMSNorm keeps its input upcast to float32 (in float32: the input itself)
ATTN_SAVED = 2  # sdpa keeps q and its output (attention width) and k and v (kv width: GQA without repeat_kv)
MLP_SAVED = 3  # gate, silu(gate) and up (the product's inputs)
ATTN_NORM_LINEARS = 3  # q, k, v: the linears whose input is the attention norm's output
FFN_NORM_LINEARS = 2  # gate, up: those whose input is the FFN norm's output
# one block's backward working memory on top of what it saved: the gradients of gate, up and their product at once
# (freed with the logits, so the step's peak is the larger of this and the logits' part, not their sum)
BACKWARD_PER_INTERMEDIATE = 3
LOGIT_COPIES = 3  # float32 tokens x vocab at the loss's backward: the log-softmax, its gradient, the logits' gradient
# KD (forward KL on every token): the teacher's float32 log-softmax and its exp live beside the student's three copies
# (its log-softmax, the difference and the product, at the KL's forward)
TEACHER_LOGIT_COPIES = 2


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only model that the estimate needs."""

    params: int
    linear_params: int  # decoder-block linear weights (quantized by QLoRA)
    lora_dims: int  # sum of in + out features over the linears LoRA adapts (times r = adapter size)
    layers: int
    hidden: int
    intermediate: int
    attn_width: int  # heads * head_dim
    vocab: int
    kv_width: int = 0  # key_value_heads * head_dim (0: attn_width)
    # a model whose blocks differ (the Nemotron-NAS layout: a sublayer may be absent, widths per block): the kv width
    # of each attention present and the intermediate size of each FFN present; empty: every block has both, at
    # kv_width and intermediate
    attentions: tuple[int, ...] = ()
    ffns: tuple[int, ...] = ()
    attn_linears: int = 4  # linears in one attention sublayer (q, k, v, o)
    ffn_linears: int = 3  # linears in one FFN sublayer (gate, up, down)

    def sublayers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(kv width of each attention, intermediate size of each FFN) over the blocks."""
        if self.attentions or self.ffns:
            return self.attentions, self.ffns
        return (self.kv_width or self.attn_width,) * self.layers, (self.intermediate,) * self.layers


@dataclass
class MemoryPlan:
    """Estimated peak memory of one training step, in GB."""

    method: str
    optimizer: str
    seq_len: int
    batch_size: int
    weight_bytes: float
    weights: float
    adapters: float
    gradients: float
    optimizer_states: float
    activations: float
    activations_no_checkpointing: float
    activations_checkpointing: float
    gradient_checkpointing: bool
    teacher: float
    total: float
    budget: float
    fits: bool
    # AdamW's step on CUDA (torch's multi-tensor form, its default there) makes one temporary the size of the second
    # moments (their square root); the activations are freed by then, so the peak holds the larger of the two
    optimizer_step: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_shape(config: Any) -> ModelShape:
    """Count parameters on the meta device and read the block sizes from the config."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    linears = [m for _, m in named]
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    attentions, ffns = nas_sublayers(text, heads, head_dim)
    in_attention = sum("attn" in name for name, _ in named)
    counts = (len(attentions), len(ffns)) if attentions or ffns else (text.num_hidden_layers,) * 2
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        linear_params=sum(m.weight.numel() for m in linears),
        lora_dims=sum(m.in_features + m.out_features for m in linears),
        layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=text.intermediate_size,
        attn_width=heads * head_dim, vocab=text.vocab_size, kv_width=kv_heads * head_dim,
        attentions=attentions, ffns=ffns,
        attn_linears=round(in_attention / max(counts[0], 1)),
        ffn_linears=round((len(named) - in_attention) / max(counts[1], 1)),
    )


def nas_sublayers(config: Any, heads: int, head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A Nemotron-NAS (DeciLM) config's sublayers: the kv width of each attention present and the intermediate size
    of each FFN present; ((), ()) for a config whose blocks are all alike."""
    blocks = getattr(config, "block_configs", None)
    if not blocks:
        return (), ()
    from layerprune.models.nemotron_nas.configuration_decilm import ffn_mult_to_intermediate_size

    attentions = tuple(heads // block.attention.n_heads_in_group * head_dim for block in blocks
                       if not block.attention.no_op)
    ffns = tuple(ffn_mult_to_intermediate_size(block.ffn.ffn_mult, config.hidden_size) for block in blocks
                 if not block.ffn.no_op)
    return attentions, ffns


def attention_bytes(shape: ModelShape, kv: int, act_bytes: int, lora_r: int = 0) -> int:
    """Bytes an attention sublayer (its norm included) saves for backward per token: full training (`lora_r` 0) or
    LoRA adapters of rank `lora_r` (peft keeps them in float32 and casts each adapted linear's input to float32
    before lora_A)."""
    h, attn = shape.hidden, shape.attn_width
    saved = NORM_INPUT_BYTES * h + act_bytes * ATTN_SAVED * (attn + kv)
    if not lora_r:  # the norm's weight keeps its normalized input, q/k/v's weights the norm's output (o_proj's
        return saved + act_bytes * 2 * h  # input is sdpa's output, saved above)
    # lora_A keeps its input: in float32, one per distinct input (the norm's output); else a float32 copy per
    # adapted linear (q, k, v and o_proj); lora_B keeps lora_A's output
    inputs = h if act_bytes == 4 else ATTN_NORM_LINEARS * h + attn
    return saved + 4 * inputs + 4 * lora_r * shape.attn_linears


def ffn_bytes(shape: ModelShape, intermediate: int, act_bytes: int, lora_r: int = 0) -> int:
    """Bytes a gated MLP sublayer (its norm included) saves for backward per token; see attention_bytes."""
    h, i = shape.hidden, intermediate
    saved = NORM_INPUT_BYTES * h + act_bytes * MLP_SAVED * i
    if not lora_r:  # the norm's normalized input and output, and the product (down_proj's input)
        return saved + act_bytes * (2 * h + i)
    inputs = h + i if act_bytes == 4 else FFN_NORM_LINEARS * h + i  # in float32 gate and up share the norm's output
    return saved + 4 * inputs + 4 * lora_r * shape.ffn_linears


def block_bytes(shape: ModelShape, act_bytes: int, lora_r: int = 0) -> int:
    """Bytes the largest block saves for backward per token (every block of a model whose blocks are alike)."""
    attentions, ffns = shape.sublayers()
    return (max((attention_bytes(shape, kv, act_bytes, lora_r) for kv in attentions), default=0)
            + max((ffn_bytes(shape, i, act_bytes, lora_r) for i in ffns), default=0))


def stack_bytes(shape: ModelShape, act_bytes: int, lora_r: int = 0) -> int:
    """Bytes all the blocks save for backward per token: each sublayer present, at its own width."""
    attentions, ffns = shape.sublayers()
    return (sum(attention_bytes(shape, kv, act_bytes, lora_r) for kv in attentions)
            + sum(ffn_bytes(shape, i, act_bytes, lora_r) for i in ffns))


def activation_bytes(shape: ModelShape, tokens: int, act_bytes: int, checkpointing: bool, lora_r: int = 0) -> float:
    """Activations at the step's peak: every block's saved tensors (checkpointed: each block's input, and one block's
    recomputed in backward), the final norm's, and the larger of the loss's logits copies (the peak while every
    block's tensors are still kept) and one block's backward working memory (after the logits are freed)."""
    per_block = block_bytes(shape, act_bytes, lora_r)
    head = 4 * shape.hidden + (0 if lora_r else 2 * act_bytes * shape.hidden)  # final norm (and lm_head's input)
    logits = 4 * LOGIT_COPIES * shape.vocab + head
    backward = act_bytes * BACKWARD_PER_INTERMEDIATE * max(shape.sublayers()[1], default=0)
    if checkpointing:
        return tokens * (shape.layers * shape.hidden * act_bytes + max(logits, per_block + backward))
    return tokens * (stack_bytes(shape, act_bytes, lora_r) + max(logits, backward))


def plan_memory(shape: ModelShape, method: str, seq_len: int, batch_size: int, optimizer: str = "adamw_torch",
                weight_bytes: int = 2, lora_r: int = 64, gradient_checkpointing: bool = True,
                teacher_params: int = 0, budget_gb: float = 80.0, teacher: ModelShape | None = None,
                act_bytes: int | None = None, teacher_weight_bytes: int | None = None,
                cuda: bool = False) -> MemoryPlan:
    """Estimate the peak of one step; `weight_bytes` 2 for bf16 weights, 4 for float32 (full fine-tuning's float32
    master weights: then `act_bytes` 2 for the bf16 autocast's activations, `teacher_weight_bytes` 2 for a bf16
    teacher beside them).

    `cuda`: torch's AdamW steps in its multi-tensor (foreach) form there, whose square root of the second moments is
    one temporary as large as they are: the step's peak is the larger of it and the activations (measured on an
    H200, full SFT of a 7B-size model in bf16: 62.85 GB = weights, gradients, two moments and that copy).

    `teacher` (KD): the teacher's weights and its logits over the batch (in float32 for the KL) are counted too.
    """
    adapter = method in ("lora", "qlora") or (method == "kd" and lora_r > 0)
    trainable = shape.lora_dims * lora_r if adapter else shape.params
    param_bytes = 4 if adapter else weight_bytes  # peft keeps adapters in float32
    if method == "qlora":  # NF4 linears; peft's prepare_model_for_kbit_training upcasts the rest to float32
        weights = shape.linear_params * 0.5 * 1.03 + (shape.params - shape.linear_params) * 4
    else:
        weights = shape.params * weight_bytes
    state = OPTIMIZER_STATE_BYTES[optimizer] or 2 * param_bytes
    tokens = seq_len * batch_size
    act_bytes = act_bytes or (2 if weight_bytes == 2 or method == "qlora" else 4)
    rank = lora_r if adapter else 0
    with_ckpt = activation_bytes(shape, tokens, act_bytes, True, rank)
    without = activation_bytes(shape, tokens, act_bytes, False, rank)
    teacher_weight_bytes = teacher_weight_bytes or weight_bytes
    teacher_bytes = teacher_params * teacher_weight_bytes
    if teacher is not None:  # weights, plus its float32 log-softmax and exp beside the student's logits copies
        teacher_bytes = teacher.params * teacher_weight_bytes + tokens * teacher.vocab * 4 * TEACHER_LOGIT_COPIES
    parts = {"weights": weights, "adapters": trainable * 4 if adapter else 0.0, "gradients": trainable * param_bytes,
             "optimizer_states": trainable * state, "teacher": teacher_bytes,
             "activations": with_ckpt if gradient_checkpointing else without}
    step = trainable * param_bytes if cuda and optimizer == "adamw_torch" else 0.0
    total = sum(parts.values()) - parts["activations"] + max(parts["activations"], step)
    plan = MemoryPlan(method=method, optimizer=optimizer, seq_len=seq_len, batch_size=batch_size,
                      weight_bytes=weight_bytes, **{k: v / GB for k, v in parts.items()},
                      activations_no_checkpointing=without / GB, activations_checkpointing=with_ckpt / GB,
                      gradient_checkpointing=gradient_checkpointing, total=total / GB, budget=budget_gb,
                      fits=total / GB <= budget_gb, optimizer_step=step / GB)
    if not adapter and weight_bytes == 2:
        plan.notes.append("all weights trained in pure bf16 (train.pure_bf16): weights, gradients and AdamW states "
                          "in bf16, no float32 master copy; updates below half a bf16 step are lost")
    elif not adapter and act_bytes == 2:
        plan.notes.append("all weights trained from float32 master weights (gradients and AdamW states in float32) "
                          "with bf16 autocast")
    return plan


def memory_bound_gb(max_memory: dict[int | str, str] | None, cuda: bool) -> float | None:
    """The --max-memory entry that bounds one training process's device, in GB: the smallest GPU entry on CUDA,
    the `cpu` entry otherwise; None without one."""
    from accelerate.utils import convert_file_size_to_int

    entries = (max_memory or {}).items()
    sizes = [convert_file_size_to_int(v) for k, v in entries if (isinstance(k, int) if cuda else k == "cpu")]
    return min(sizes) / GB if sizes else None


def enforce_bound(plan: MemoryPlan, bound_gb: float | None) -> MemoryPlan:
    """Refuse, before anything is loaded, a plan whose peak exceeds the --max-memory bound (with its numbers)."""
    if bound_gb is not None and plan.total > bound_gb:
        from layerprune.core.errors import LayerpruneError

        parts = ", ".join(f"{name} {getattr(plan, name):.2f}" for name in
                          ("weights", "adapters", "gradients", "optimizer_states", "activations", "optimizer_step",
                           "teacher")
                          if getattr(plan, name) > 0)
        raise LayerpruneError(
            f"the memory plan ({plan.method}, {plan.optimizer}, batch {plan.batch_size} x {plan.seq_len}) needs about "
            f"{plan.total:.2f} GB ({parts} GB), over --max-memory {bound_gb:.2f} GB: lower train.batch_size or "
            "train.max_length, or use qlora"
        )
    return plan


def choose_optimizer(shape: ModelShape, method: str, requested: str, cuda: bool, sharded: bool = False,
                     max_memory: dict[int | str, str] | None = None, **kwargs: Any) -> tuple[str, MemoryPlan]:
    """`auto`: AdamW, or 8-bit then paged 8-bit AdamW when training all weights would not fit (one CUDA device;
    never under FSDP or DeepSpeed ZeRO, whose sharded optimizer states bitsandbytes' optimizers do not support).

    `max_memory` (--max-memory, as `RunSettings.resolved_max_memory` gives it) is a bound: the budget is at most
    its entry for the device, and a plan over it is refused here, before loading."""
    bound = memory_bound_gb(max_memory, cuda)
    if bound is not None:
        kwargs["budget_gb"] = min(kwargs.get("budget_gb", 80.0), bound)
    optimizer, plan = _choose_optimizer(shape, method, requested, cuda, sharded, **kwargs)
    return optimizer, enforce_bound(plan, bound)


def _choose_optimizer(shape: ModelShape, method: str, requested: str, cuda: bool, sharded: bool,
                      **kwargs: Any) -> tuple[str, MemoryPlan]:
    if requested != "auto":
        if sharded and requested in EIGHT_BIT:
            from layerprune.core.errors import LayerpruneError

            raise LayerpruneError(f"train.optimizer {requested} (bitsandbytes) does not work under FSDP or DeepSpeed "
                                  "ZeRO; use adamw_torch or auto")
        return requested, advise(plan_memory(shape, method, optimizer=requested, cuda=cuda, **kwargs))
    plan = plan_memory(shape, method, optimizer="adamw_torch", cuda=cuda, **kwargs)
    all_weights = method == "full" or (method == "kd" and not kwargs.get("lora_r"))
    what = "full fine-tuning" if method == "full" else "distillation into all weights"
    if plan.fits or not all_weights or not cuda or sharded:
        if not plan.fits and all_weights:
            why = "is not used under FSDP or ZeRO (shard the states instead)" if sharded else "would need CUDA"
            plan.notes.append(f"{what} does not fit; 8-bit AdamW (bitsandbytes) {why}")
        return "adamw_torch", advise(plan)
    for candidate in ("adamw_8bit", "paged_adamw_8bit"):
        smaller = plan_memory(shape, method, optimizer=candidate, cuda=cuda, **kwargs)
        if smaller.fits or candidate == "paged_adamw_8bit":
            smaller.notes.append(f"{what} with AdamW needs {plan.total:.1f} GB > {plan.budget:.0f} GB: "
                                 f"switched to {candidate}")
            return candidate, smaller
    raise AssertionError("unreachable")


def advise(plan: MemoryPlan) -> MemoryPlan:
    """Add what to change when the plan does not fit."""
    if not plan.fits:
        hint = "turn on gradient checkpointing, " if not plan.gradient_checkpointing else ""
        plan.notes.append(f"over budget: {hint}lower train.batch_size or train.max_length, or use qlora")
    return plan


def format_plan(plan: MemoryPlan, model: str) -> str:
    """A small table for the terminal."""
    rows = [("weights", plan.weights), ("LoRA adapters", plan.adapters), ("gradients", plan.gradients),
            (f"optimizer ({plan.optimizer})", plan.optimizer_states),
            ("teacher (unpruned, beside the student)", plan.teacher),
            (f"activations ({'with' if plan.gradient_checkpointing else 'without'} grad checkpointing)",
             plan.activations),
            ("optimizer step's temporary (activations freed by then)", plan.optimizer_step)]
    lines = [
        f"memory plan: {model}, method {plan.method}, batch {plan.batch_size} x {plan.seq_len} tokens, "
        f"{'bf16' if plan.weight_bytes == 2 else 'float32'} weights"
    ]
    lines += [f"  {name:48s} {value:9.2f} GB" for name, value in rows if value > 0]
    lines.append(
        f"  {'(activations with / without checkpointing)':48s} {plan.activations_checkpointing:9.2f} / "
        f"{plan.activations_no_checkpointing:.2f} GB"
    )
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"  {'estimated peak':48s} {plan.total:9.2f} GB  -> {verdict} in {plan.budget:.0f} GB")
    lines += [f"  note: {note}" for note in plan.notes]
    return "\n".join(lines)


def plan_surgery(shape: ModelShape, teacher: ModelShape, method: str, weight_bytes: int, budget_gb: float,
                 trains_block: bool, cached_tokens: int, seq_len: int, batch_size: int) -> MemoryPlan:
    """merge, local and chains without a trainer: the student and the teacher in memory; local adds the cached teacher
    states (input and target per token, in the weights' dtype) and one block trained in float32 (weights, gradients,
    two AdamW moments) with its own activations for one step."""
    block = (shape.params - shape.vocab * shape.hidden) / max(shape.layers, 1) if trains_block else 0.0
    one_block = replace(shape, layers=1, vocab=0)  # one block's saved activations, no logits
    act = activation_bytes(one_block, seq_len * batch_size, 4, False) if trains_block else 0.0
    cache = 2 * cached_tokens * shape.hidden * weight_bytes if trains_block else 0.0
    parts = {"weights": shape.params * weight_bytes, "adapters": 0.0, "gradients": block * 4,
             "optimizer_states": block * (4 + 8), "teacher": teacher.params * weight_bytes + cache,
             "activations": act}
    total = sum(parts.values())
    plan = MemoryPlan(method=method, optimizer="adamw_torch (one block)" if trains_block else "none",
                      seq_len=seq_len, batch_size=batch_size, weight_bytes=weight_bytes,
                      **{k: v / GB for k, v in parts.items()}, activations_no_checkpointing=act / GB,
                      activations_checkpointing=act / GB, gradient_checkpointing=False, total=total / GB,
                      budget=budget_gb, fits=total / GB <= budget_gb)
    if trains_block:
        plan.notes.append(f"local: {cache / GB:.2f} GB of cached teacher states (in 'teacher'), one block "
                          "trained in float32 (its master copy and AdamW states in 'optimizer')")
    return advise(plan)
