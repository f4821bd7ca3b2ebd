"""Model geometry: the shapes that decide memory, read offline from an HF `config.json`.

One frozen object that every other part (provider, memory model, planner) reads. It knows
each layer's type, so hybrid models (Gated DeltaNet linear attention mixed with full
attention) and MoE models are priced layer by layer.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MODEL_CONFIG_DIR = Path(__file__).with_name("model_configs")


class LayerKind(enum.StrEnum):
    """A layer's mixer: softmax attention, or Gated DeltaNet linear attention. The value is the
    HF `layer_types` word."""

    ATTENTION = "attention"
    LINEAR_ATTENTION = "linear_attention"


ATTENTION = LayerKind.ATTENTION
LINEAR_ATTENTION = LayerKind.LINEAR_ATTENTION


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
    # One entry per layer (given as LayerKind or its value).
    layer_types: tuple[LayerKind, ...]
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
        # Callers that resize or edit a geometry pass the HF words; the layers' kinds are
        # compared as members from here on.
        object.__setattr__(self, "layer_types", tuple(LayerKind(t) for t in self.layer_types))
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

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (Megatron's RotaryEmbedding: kv_channels x
        rotary_percent)."""
        return int(self.head_dim * self.rotary_fraction)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def first_layers(self, count: int, name: str | None = None) -> ModelGeometry:
        """This model cut to its first `count` layers (the layer pattern's start kept): the
        real dims of a model too large for the machine at hand."""
        if not 1 <= count <= self.num_layers:
            raise ValueError(f"{self.name}: cannot keep {count} of its {self.num_layers} "
                             f"layers; give 1 to {self.num_layers}")
        return replace(self, name=name or f"{self.name}-{count}L", num_layers=count,
                       layer_types=self.layer_types[:count], moe_layers=self.moe_layers[:count])


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


class ModelConfigError(ValueError):
    """A model config that cannot be read as a geometry: the message names the file, the
    field, the value seen and what to do."""


def load_geometry(model: str | Path) -> ModelGeometry:
    """Read a shipped model name, a config.json path or a checkpoint folder, offline."""
    path = _resolve_config_path(model)
    try:
        raw = json.loads(path.read_text())
    except UnicodeDecodeError as error:
        raise ModelConfigError(f"{path}: not a text file ({error}); point at the model's "
                               "config.json") from None
    except json.JSONDecodeError as error:
        raise ModelConfigError(
            f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column "
            f"{error.colno}); fix the file or point at the model's config.json") from None
    # path.stem, not Path(model).stem: "Qwen3.5-27B" would lose its ".5-27B" as a suffix.
    name = path.stem if path.parent == MODEL_CONFIG_DIR else str(model)
    return geometry_from_hf_dict(raw, name=name, source=str(path))


class _Fields:
    """A config's fields, read with the checks a geometry needs; every error names the file
    (or the model when there is none), the field and the value."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where = cfg, where

    def _fail(self, key: str, problem: str) -> ModelConfigError:
        return ModelConfigError(
            f"{self.where}: field {key!r} {problem}; fix config.json (a Hugging Face model "
            "config) or use a shipped model name")

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1,
                required: bool = False) -> int:
        """An integer >= `minimum`: `default` when absent or null (falsy, as HF's own
        fallbacks read it), an error when `required` and absent."""
        value = self.cfg.get(key)
        if value is None or (value == 0 and not required and default is not None):
            if required or default is None:
                raise self._fail(key, "is missing" if key not in self.cfg else "is null")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not value.is_integer()):
            raise self._fail(key, f"is {value!r}, not an integer")
        if value < minimum:
            raise self._fail(key, f"is {value!r}; it must be >= {minimum}")
        return int(value)

    def number(self, key: str, default: float) -> float:
        """A positive number: `default` when absent, null or 0."""
        value = self.cfg.get(key)
        if value is None or value == 0:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self._fail(key, f"is {value!r}, not a positive number")
        return float(value)


def geometry_from_hf_dict(raw: dict[str, Any], *, name: str, source: str = "") -> ModelGeometry:
    where = source or f"model {name}"
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where}: holds a JSON {type(raw).__name__}, not an object; "
                               "point at the model's config.json")
    # Multimodal Qwen3.5 configs nest the language model under text_config.
    text = raw.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ModelConfigError(f"{where}: field 'text_config' is {text!r}, not an object")
    cfg = dict(text or raw)
    read = _Fields(cfg, where)
    num_layers = read.integer("num_hidden_layers", required=True)
    hidden = read.integer("hidden_size", required=True)
    heads = read.integer("num_attention_heads", required=True)
    groups = read.integer("num_key_value_heads", heads)
    head_dim = read.integer("head_dim", hidden // heads)

    raw_types = cfg.get("layer_types")
    if raw_types:
        if not isinstance(raw_types, list) or len(raw_types) != num_layers:
            raise read._fail("layer_types", f"is {raw_types!r}; it must list one type per "
                             f"layer ({num_layers} layers)")
        layer_types = tuple(
            LINEAR_ATTENTION if t == LINEAR_ATTENTION else ATTENTION for t in raw_types
        )
    elif cfg.get("full_attention_interval"):
        interval = read.integer("full_attention_interval")
        layer_types = tuple(
            ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
        )
    else:
        layer_types = (ATTENTION,) * num_layers

    num_experts = read.integer("num_experts", 0, minimum=0) or read.integer(
        "num_local_experts", 0, minimum=0)
    if num_experts:
        sparse_step = read.integer("decoder_sparse_step", 1)
        mlp_only = cfg.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list):
            raise read._fail("mlp_only_layers", f"is {mlp_only!r}, not a list of layer numbers")
        mlp_only = set(mlp_only)
        moe_layers = tuple(
            (i not in mlp_only) and ((i + 1) % sparse_step == 0) for i in range(num_layers)
        )
    else:
        moe_layers = (False,) * num_layers

    linear = None
    if LINEAR_ATTENTION in layer_types:
        linear = LinearAttentionDims(
            num_key_heads=read.integer("linear_num_key_heads", required=True),
            num_value_heads=read.integer("linear_num_value_heads", required=True),
            key_head_dim=read.integer("linear_key_head_dim", required=True),
            value_head_dim=read.integer("linear_value_head_dim", required=True),
            conv_kernel_size=read.integer("linear_conv_kernel_dim", 4),
        )

    model_type = str(cfg.get("model_type", ""))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise read._fail("rope_parameters" if cfg.get("rope_parameters") else "rope_scaling",
                         f"is {rope!r}, not an object")
    rope_theta = read.number("rope_theta", float(rope.get("rope_theta") or 10000.0))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if heads % groups:
        raise read._fail("num_key_value_heads", f"is {groups}, which does not divide "
                         f"num_attention_heads={heads}")
    return ModelGeometry(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=read.integer("intermediate_size", 4 * hidden),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=read.integer("vocab_size", required=True),
        layer_types=layer_types,
        moe_layers=moe_layers,
        num_experts=num_experts,
        moe_router_topk=read.integer("num_experts_per_tok", 0, minimum=0),
        moe_ffn_hidden_size=read.integer("moe_intermediate_size", 0, minimum=0),
        shared_expert_ffn_hidden_size=read.integer("shared_expert_intermediate_size", 0,
                                                   minimum=0),
        # Qwen3 and later normalise q and k per head; Llama does not.
        qk_layernorm=model_type.startswith(("qwen3", "qwen4")),
        gated_attention_output=bool(
            cfg.get("attn_output_gate", model_type.startswith("qwen3_5") or "next" in model_type)
        ),
        linear_attention=linear,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16",
        rope_theta=rope_theta,
        rotary_fraction=read.number(
            "partial_rotary_factor", float(rope.get("partial_rotary_factor") or 1.0)),
        max_position_embeddings=read.integer("max_position_embeddings", 4096),
        norm_epsilon=read.number("rms_norm_eps", 1e-6),
        source=source,
    )
