"""Calibration cells: geometries, recompute policies and the seeded off-grid matrix.

A cell is one (geometry, recompute policy, LoRA rank, TP size) model and one micro-batch
(packed lengths, outputs, grad, caller loss). Lengths are drawn from a seeded generator, never
typed in, and a packed row never lands within `PROBE_POINT_MARGIN` of a probe point: at its
points the probe is exact by construction, so cells there would measure nothing about it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from art.megatron.geometry import ModelGeometry, geometry_from_hf_dict
from art.megatron.recompute import RecomputePolicy
from art.trainer_rank.measuring.probe import PROBE_TOKENS

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_targets_for(geometry: ModelGeometry) -> tuple[str, ...]:
    """LORA_TARGETS, less linear_qkv where q and the output gate share it (no LoRA mapping)."""
    if geometry.gated_attention_output:
        return tuple(t for t in LORA_TARGETS if t != "linear_qkv")
    return LORA_TARGETS
# A packed row within 4% of a probe point is redrawn.
PROBE_POINT_MARGIN = 0.04
# CPU: unfused attention keeps [heads, S, S] fp32 scores per layer and three such tensors in
# its backward, so rows stop at 4k tokens on a shared 2-core machine with ~20 GiB.
MIN_TOKENS, MAX_TOKENS = 100, 4096
GRAD_OUTPUTS = ("logprobs", "top_k=20", "logits", "hidden_states", "logprobs,top_k=8")
NOGRAD_OUTPUTS = ("logprobs", "logits", "top_k=20")
LOSSES = ("synthetic", "rl")

Policy = RecomputePolicy

POLICIES: tuple[Policy, ...] = (
    Policy("none", None),
    Policy("selective default", "selective"),
    Policy("selective core_attn+mlp", "selective", modules=("core_attn", "mlp")),
    Policy("selective mlp", "selective", modules=("mlp",)),
    Policy("selective layernorm", "selective", modules=("layernorm",)),
    Policy("full uniform 1", "full", "uniform", 1),
    Policy("full uniform 2", "full", "uniform", 2),
    Policy("full block 2", "full", "block", 2),
)
POLICY_BY_NAME = {p.name: p for p in POLICIES}


def calibration_geometries() -> dict[str, ModelGeometry]:
    """Small geometries (qk-norm, SwiGLU, RoPE) sized for 2 shared CPU cores: two GQA shapes
    and an MQA one (one KV group, where K and V are smallest next to Q), and two hybrids
    (Gated DeltaNet + attention, dense and MoE)."""
    def make(name: str, hidden: int, heads: int, groups: int, ffn: int, vocab: int):
        return geometry_from_hf_dict(dict(
            model_type="qwen3", num_hidden_layers=4, hidden_size=hidden, intermediate_size=ffn,
            num_attention_heads=heads, num_key_value_heads=groups, head_dim=hidden // heads,
            vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
        ), name=name)

    return {
        "gqa-128": make("gqa-128", 128, 8, 4, 384, 1024),
        "gqa-256": make("gqa-256", 256, 8, 2, 704, 2048),
        "mqa-192": make("mqa-192", 192, 6, 1, 512, 1536),
        "hybrid-128": hybrid_geometry(moe=False),
        "hybrid-moe-128": hybrid_geometry(moe=True),
        "moe-128": moe_geometry(),
    }


DENSE_GEOMETRIES = ("gqa-128", "gqa-256", "mqa-192")
# Attention and routed experts in every layer (Qwen3-MoE's pattern): without a Gated DeltaNet
# rule, a MoE layer's routed experts set its peaks.
MOE_GEOMETRIES = ("moe-128",)
HYBRID_GEOMETRIES = ("hybrid-128", "hybrid-moe-128")


def moe_geometry() -> ModelGeometry:
    """A Qwen3-MoE-style model sized like gqa-128: GQA attention and 8 routed experts (top-2,
    no shared expert) in each of its four layers."""
    return geometry_from_hf_dict(dict(
        model_type="qwen3_moe", num_hidden_layers=4, hidden_size=128, intermediate_size=384,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_size=1024,
        max_position_embeddings=8192, tie_word_embeddings=False, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True), name="moe-128")


def hybrid_geometry(moe: bool = False) -> ModelGeometry:
    """A Qwen3.5-style hybrid sized like gqa-128: three Gated DeltaNet layers then one gated
    attention layer; `moe`: every MLP is routed experts plus a shared expert."""
    raw: dict[str, object] = dict(
        model_type="qwen3_5_text", num_hidden_layers=4, hidden_size=128,
        intermediate_size=384, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
        vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False,
        full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25)
    if moe:
        raw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64)
    return geometry_from_hf_dict(raw, name="hybrid-moe-128" if moe else "hybrid-128")


@dataclass(frozen=True)
class Cell:
    geometry: str
    policy: str
    lora_rank: int
    tensor_parallel: int
    lengths: tuple[int, ...]
    outputs: str
    grad: bool
    dtype: str = "float32"
    loss: str = "synthetic"  # the caller loss: "synthetic" or "rl" (see losses.py)
    # "local": Megatron's local spec as the CPU runs it by default (torch norms and SwiGLU,
    # the segmented flash attention); "local-unfused": the same with Megatron's unfused
    # attention; "gpu-shaped": the CPU stand-ins that keep what a GPU build's fused kernels
    # keep (art/megatron/cpu_fused.py) with the segmented flash attention.
    build: str = "local"
    # One group sharing a prompt of this many tokens (its first `shared_prefix` tokens;
    # `lengths` are the sequences' full lengths), laid out once as a prefix tree; `deeper`:
    # tokens the first two sequences also share after the prompt (a tree of depth 3).
    shared_prefix: int = 0
    deeper: int = 0
    # Set: the model is built with this policy and `policy` (a recompute rung's name, see
    # art/megatron/recompute_ladder.py) is switched on for this micro-batch at run time.
    built_with: str = ""
    # Context parallel ranks the row is split over (the segmented flash attention).
    context_parallel: int = 1
    # Expert parallel ranks a MoE model's experts are spread over (every rank feeds the same
    # row: each rank's experts take the tokens of every rank routed to them).
    expert_parallel: int = 1

    @property
    def built_policy(self) -> str:
        return self.built_with or self.policy

    @property
    def logical_tokens(self) -> int:
        return sum(self.lengths)


def off_probe_points(total: int, probe_tokens: tuple[int, ...] = PROBE_TOKENS) -> bool:
    return all(abs(total - t) > PROBE_POINT_MARGIN * t for t in probe_tokens)


def draw_lengths(rng: random.Random, *, low: int = MIN_TOKENS, high: int = MAX_TOKENS,
                 multiple: int = 1, probe_tokens: tuple[int, ...] = PROBE_TOKENS
                 ) -> tuple[int, ...]:
    """One packed row: a log-uniform total in [low, high] off the probe points, as one
    sequence (half the rows) or split at random into 2-48 sequences of >= 8 tokens. With
    `multiple` > 1 (TP with sequence parallel pads rows) the total is a multiple of it."""
    while True:
        total = int(round(low * (high / low) ** rng.random()))
        total = max(low, total - total % multiple)
        if off_probe_points(total, probe_tokens):
            break
    if rng.random() < 0.5 or total < 32:
        return (total,)
    pieces = rng.randint(2, min(48, total // 8))
    cuts = sorted(rng.sample(range(8, total - 7), pieces - 1)) if pieces > 1 else []
    lengths, last = [], 0
    for cut in cuts + [total]:
        if cut - last >= 8:
            lengths.append(cut - last)
            last = cut
    lengths[-1] += total - sum(lengths)
    rng.shuffle(lengths)
    return tuple(lengths)


def off_grid_matrix(seed: int = 0, *, rows_per_model: int = 6, tensor_parallel: int = 1,
                    geometries: tuple[str, ...] = ("gqa-128", "gqa-256", "mqa-192"),
                    policies: tuple[str, ...] = tuple(POLICY_BY_NAME),
                    max_tokens: int = MAX_TOKENS, build: str = "local") -> list[Cell]:
    """Every geometry x policy (LoRA rank 8), plus ranks 1 and 64 for two policies, each model
    measuring `rows_per_model` seeded rows with grad and half as many without, outputs and
    caller losses rotating."""
    rng = random.Random(seed)
    cells: list[Cell] = []
    for geo in geometries:
        for policy in policies:
            ranks = [8]
            if policy in ("selective default", "full uniform 1") and geo == geometries[0]:
                ranks += [1, 64]
            for rank in ranks:
                n = rows_per_model if rank == 8 else max(2, rows_per_model // 3)
                for i in range(n):
                    lengths = draw_lengths(rng, high=max_tokens, multiple=tensor_parallel)
                    outputs = GRAD_OUTPUTS[rng.randrange(len(GRAD_OUTPUTS))]
                    loss = LOSSES[i % 2] if "logprobs" in outputs else "synthetic"
                    cells.append(Cell(geo, policy, rank, tensor_parallel, lengths, outputs,
                                      True, loss=loss, build=build))
                for _ in range(n // 2):
                    lengths = draw_lengths(rng, high=max_tokens, multiple=tensor_parallel)
                    outputs = NOGRAD_OUTPUTS[rng.randrange(len(NOGRAD_OUTPUTS))]
                    cells.append(Cell(geo, policy, rank, tensor_parallel, lengths, outputs,
                                      False, build=build))
    return cells


def shared_prefix_cells(seed: int, *, geometries: tuple[str, ...], policies: tuple[str, ...],
                        rows: int, tensor_parallel: int = 1, max_tokens: int = MAX_TOKENS,
                        build: str = "local") -> list[Cell]:
    """Seeded groups sharing a prompt, per geometry and policy: `rows` with grad and half as
    many without. 2-16 sequences; prompts from one token to most of the sequence; completions
    from one token to several 64-token chunks; some with a deeper shared part. The packed row
    (prompt once) stays off the probe points. Its own generator: the rest of a matrix is the
    same with or without these rows."""
    rng = random.Random(seed + 1000)
    cells: list[Cell] = []
    for geo in geometries:
        for policy in policies:
            for i in range(rows + rows // 2):
                grad = i < rows
                while True:
                    n = rng.choice((2, 2, 3, 4, 8, 16))
                    prompt = rng.choice((1, rng.randint(2, 63), rng.randint(64, 900)))
                    deeper = rng.randint(3, 80) if n > 2 and rng.random() < 0.4 else 0
                    tails = [max(1, int(round(rng.choice((1.5, 40.0, 400.0))
                                              * rng.random()))) for _ in range(n)]
                    lengths = tuple(prompt + (deeper if k < 2 else 0) + t
                                    for k, t in enumerate(tails))
                    packed = sum(lengths) - prompt * (n - 1) - (deeper if deeper else 0)
                    if MIN_TOKENS <= packed <= max_tokens and off_probe_points(packed) and (
                            packed % tensor_parallel == 0):
                        break
                outputs = (GRAD_OUTPUTS if grad else NOGRAD_OUTPUTS)[
                    rng.randrange(len(GRAD_OUTPUTS if grad else NOGRAD_OUTPUTS))]
                loss = LOSSES[i % 2] if grad and "logprobs" in outputs else "synthetic"
                cells.append(Cell(geo, policy, 8, tensor_parallel, lengths, outputs, grad,
                                  loss=loss, build=build, shared_prefix=prompt, deeper=deeper))
    return cells


# The policy a model is built with -> the rungs switched on it at run time (4-layer models).
RUNGS_BY_BUILT: dict[str, tuple[str, ...]] = {
    "selective default": ("none", "selective core_attn+mlp",
                          "full block 1 (selective core_attn on the rest)",
                          "full block 3 (selective core_attn on the rest)", "full uniform 1"),
    "full uniform 1": ("none", "selective core_attn",
                       "full block 2 (selective core_attn on the rest)"),
}


# A model whose every MLP is MoE has no `core_attn,mlp` rung (mlp does nothing there) and has
# `core_attn,moe` instead.
MOE_RUNGS_BY_BUILT: dict[str, tuple[str, ...]] = {
    "selective default": ("none", "selective core_attn+moe",
                          "full block 1 (selective core_attn on the rest)", "full uniform 1"),
    "full uniform 1": ("selective core_attn", "selective core_attn+moe"),
}


def rung_cells(seed: int, *, geometries: tuple[str, ...], rows: int, tensor_parallel: int = 1,
               max_tokens: int = MAX_TOKENS) -> list[Cell]:
    """Seeded grad rows for each rung switched at run time on a model built with another
    policy (`RUNGS_BY_BUILT`, `MOE_RUNGS_BY_BUILT` for MoE models): without grad no rung
    keeps anything, so only grad rows."""
    rng = random.Random(seed + 2000)
    cells: list[Cell] = []
    for geo in geometries:
        moe = all(calibration_geometries()[geo].moe_layers)
        by_built = MOE_RUNGS_BY_BUILT if moe else RUNGS_BY_BUILT
        for built, rungs in by_built.items():
            for rung in rungs:
                for i in range(rows):
                    lengths = draw_lengths(rng, high=max_tokens, multiple=tensor_parallel)
                    outputs = GRAD_OUTPUTS[rng.randrange(len(GRAD_OUTPUTS))]
                    loss = LOSSES[i % 2] if "logprobs" in outputs else "synthetic"
                    cells.append(Cell(geo, rung, 8, tensor_parallel, lengths, outputs, True,
                                      loss=loss, built_with=built))
    return cells


def test_slice(probe_tokens: tuple[int, ...], seed: int = 0) -> list[Cell]:
    """A few seeded off-grid cells for the test suite: one small model, the policies whose
    pricing differs most (none, mlp recompute, a full unit of two layers), grad and no grad."""
    rng = random.Random(seed)
    cells: list[Cell] = []
    for policy in ("none", "selective core_attn+mlp", "full uniform 2"):
        for outputs, grad, loss in (("logprobs", True, "rl"), ("hidden_states", True,
                                                               "synthetic"),
                                    ("logprobs", False, "synthetic")):
            lengths = draw_lengths(rng, low=probe_tokens[1], high=probe_tokens[-1],
                                   probe_tokens=probe_tokens)
            cells.append(Cell("gqa-128", policy, 8, 1, lengths, outputs, grad, loss=loss))
    return cells


test_slice.__test__ = False  # type: ignore[attr-defined]  # not a pytest test
