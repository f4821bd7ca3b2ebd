"""Model geometry: the shapes that decide memory, read offline from an HF `config.json`.

One frozen object that every other part (provider, memory model, planner) reads. It knows
each layer's type, so hybrid models (Gated DeltaNet linear attention mixed with full
attention) and MoE models are priced layer by layer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODEL_CONFIG_DIR = Path(__file__).with_name("model_configs")

ATTENTION = "attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class LinearAttentionDims:
    """Gated DeltaNet dimensions (Qwen3.5 / Qwen3-Next `linear_*` config keys)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    # One entry per layer: ATTENTION or LINEAR_ATTENTION.
    layer_types: tuple[str, ...]
    # One entry per layer: True where the MLP is a mixture of experts.
    moe_layers: tuple[bool, ...]
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    qk_layernorm: bool = False
    gated_attention_output: bool = False
    linear_attention: LinearAttentionDims | None = None
    tied_embeddings: bool = False
    dtype: str = "bfloat16"
    rope_theta: float = 10000.0
    # Fraction of each head's dims that RoPE rotates (HF `partial_rotary_factor`).
    rotary_fraction: float = 1.0
    max_position_embeddings: int = 4096
    norm_epsilon: float = 1e-6
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"{self.name}: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_layers} layers"
            )
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(
                f"{self.name}: moe_layers has {len(self.moe_layers)} entries for "
                f"{self.num_layers} layers"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{self.name}: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_query_groups={self.num_query_groups}"
            )

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def is_hybrid(self) -> bool:
        return LINEAR_ATTENTION in self.layer_types

    @property
    def dtype_bytes(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shipped_model_names() -> list[str]:
    return sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.json"))


def _resolve_config_path(model: str | Path) -> Path:
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    shipped = MODEL_CONFIG_DIR / f"{model}.json"
    if shipped.is_file():
        return shipped
    raise ValueError(
        f"model {str(model)!r} is neither a config.json path nor a shipped model; "
        f"shipped: {', '.join(shipped_model_names())}"
    )


def load_geometry(model: str | Path) -> ModelGeometry:
    """Read a shipped model name, a config.json path or a checkpoint folder, offline."""
    path = _resolve_config_path(model)
    with path.open() as f:
        raw = json.load(f)
    # path.stem, not Path(model).stem: "Qwen3.5-27B" would lose its ".5-27B" as a suffix.
    name = path.stem if path.parent == MODEL_CONFIG_DIR else str(model)
    return geometry_from_hf_dict(raw, name=name, source=str(path))


def geometry_from_hf_dict(raw: dict[str, Any], *, name: str, source: str = "") -> ModelGeometry:
    # Multimodal Qwen3.5 configs nest the language model under text_config.
    cfg = dict(raw.get("text_config") or raw)
    num_layers = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    groups = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)

    raw_types = cfg.get("layer_types")
    if raw_types:
        layer_types = tuple(
            LINEAR_ATTENTION if t == "linear_attention" else ATTENTION for t in raw_types
        )
    elif cfg.get("full_attention_interval"):
        interval = int(cfg["full_attention_interval"])
        layer_types = tuple(
            ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
        )
    else:
        layer_types = (ATTENTION,) * num_layers

    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if num_experts:
        sparse_step = int(cfg.get("decoder_sparse_step") or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(
            (i not in mlp_only) and ((i + 1) % sparse_step == 0) for i in range(num_layers)
        )
    else:
        moe_layers = (False,) * num_layers

    linear = None
    if LINEAR_ATTENTION in layer_types:
        linear = LinearAttentionDims(
            num_key_heads=int(cfg["linear_num_key_heads"]),
            num_value_heads=int(cfg["linear_num_value_heads"]),
            key_head_dim=int(cfg["linear_key_head_dim"]),
            value_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel_size=int(cfg.get("linear_conv_kernel_dim") or 4),
        )

    model_type = str(cfg.get("model_type", ""))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelGeometry(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(cfg.get("intermediate_size") or 4 * hidden),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        layer_types=layer_types,
        moe_layers=moe_layers,
        num_experts=num_experts,
        moe_router_topk=int(cfg.get("num_experts_per_tok") or 0),
        moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0),
        shared_expert_ffn_hidden_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        # Qwen3 and later normalise q and k per head; Llama does not.
        qk_layernorm=model_type.startswith(("qwen3", "qwen4")),
        gated_attention_output=bool(
            cfg.get("attn_output_gate", model_type.startswith("qwen3_5") or "next" in model_type)
        ),
        linear_attention=linear,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16",
        rope_theta=rope_theta,
        rotary_fraction=float(
            cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        norm_epsilon=float(cfg.get("rms_norm_eps") or 1e-6),
        source=source,
    )
