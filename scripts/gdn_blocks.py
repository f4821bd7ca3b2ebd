#!/usr/bin/env python
"""What one Gated DeltaNet layer keeps for backward, block by block: priced vs measured.

    .venv/bin/python scripts/gdn_blocks.py [--tokens 1000] [--dtype bfloat16]

Builds a small hybrid (Gated DeltaNet + attention, LoRA on o_proj and the MLP, the GDN
linears frozen as under LoRA) through the Provider, runs its first (Gated DeltaNet) layer
forward with a saved-tensor hook that attributes every storage kept for backward to the block
whose op created it (parameters excluded; a storage counts once), and prints it
next to the default formulas' block terms (`art/trainer_rank/pricing/layers_gdn.py`, composed
in `layers.py`). Writes bench/calibration/gdn_blocks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def hybrid_geometry(moe: bool = False):
    sys.path.insert(0, str(ROOT / "scripts"))
    from _calibration.cells import hybrid_geometry as calibration_hybrid

    return calibration_hybrid(moe)


class BlockLabels:
    """The block running now, set by module hooks and by wrapping the GDN kernels."""

    def __init__(self) -> None:
        self.label = "input norm + in_proj"

    def set(self, label: str):
        def hook(*_: Any) -> None:
            self.label = label
        return hook


def measure(tokens: int, dtype: str) -> tuple[list[tuple[str, int]], Any, Any]:
    import torch
    from megatron.core.ssm import gated_delta_net
    from peft import LoraConfig

    from art.megatron.provider import Provider
    from art.megatron.settings import Settings

    geometry = hybrid_geometry()
    provider = Provider(geometry, settings=Settings(), dtype=dtype, lora=LoraConfig(
        r=8, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]))
    provider.initialize_distributed()
    model = provider.build_model(seed=0)
    layer = model.decoder.layers[0]
    mixer = layer.self_attention
    labels = BlockLabels()
    hooks = [
        mixer.in_proj.register_forward_pre_hook(labels.set("input norm + in_proj")),
        mixer.in_proj.register_forward_hook(labels.set("split, qkv transpose copy")),
        mixer.conv1d.register_forward_pre_hook(labels.set("causal conv1d + silu")),
        mixer.out_proj.register_forward_pre_hook(labels.set("out_proj")),
        mixer.register_forward_hook(labels.set("residual add")),
        layer.pre_mlp_layernorm.register_forward_pre_hook(labels.set("pre-MLP norm")),
        layer.mlp.linear_fc1.register_forward_pre_hook(labels.set("fc1")),
        layer.mlp.linear_fc1.register_forward_hook(labels.set("swiglu")),
        layer.mlp.linear_fc2.register_forward_pre_hook(labels.set("fc2")),
    ]
    originals = {n: getattr(gated_delta_net, n) for n in ("l2norm", "chunk_gated_delta_rule")}
    original_norm = gated_delta_net.GatedDeltaNet._apply_gated_norm

    def wrap(label: str, after: str, fn):
        def wrapped(*args: Any, **kwargs: Any):
            labels.label = label
            out = fn(*args, **kwargs)
            labels.label = after
            return out
        return wrapped

    gated_delta_net.l2norm = wrap("q/k l2norm", "q/k repeat, gates (g, beta)",
                                  originals["l2norm"])
    gated_delta_net.chunk_gated_delta_rule = wrap(
        "gated delta rule", "gated output norm", originals["chunk_gated_delta_rule"])
    gated_delta_net.GatedDeltaNet._apply_gated_norm = wrap(
        "gated output norm", "output transpose copy", original_norm)
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    created: dict[int, str] = {}  # storage -> the block whose op created it

    class Creation(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in inputs:  # a new storage (addresses are reused: overwrite)
                        created[ptr] = labels.label
            return out

    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (created.get(ptr, labels.label), storage.nbytes())
        return t

    torch_dtype = next(model.parameters()).dtype
    x = torch.randn(tokens, 1, geometry.hidden_size, dtype=torch_dtype, requires_grad=True)
    try:
        with Creation(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            labels.label = "layer input"
            x_in = x * 1.0
            labels.label = "input norm + in_proj"
            out, _ = layer(hidden_states=x_in, attention_mask=None)
    finally:
        for h in hooks:
            h.remove()
        for name, fn in originals.items():
            setattr(gated_delta_net, name, fn)
        gated_delta_net.GatedDeltaNet._apply_gated_norm = original_norm
    del out
    per_block: dict[str, int] = {}
    for label, nbytes in seen.values():
        per_block[label] = per_block.get(label, 0) + nbytes
    return list(per_block.items()), provider, geometry


def priced(provider: Any, tokens: int) -> list[tuple[str, float]]:
    from art.trainer_rank.pricing.layer_terms import PricedKind
    from art.trainer_rank.pricing.layers import keeps_layer_input, kept_parts, layer_blocks
    from art.trainer_rank.pricing.model import MemoryModel

    dims = MemoryModel.for_provider(provider).dims
    blocks = layer_blocks(dims, PricedKind.LINEAR_ATTENTION, tokens)
    parts = kept_parts(blocks, frozenset())
    named = list(zip([b.name for b in blocks], parts))
    if keeps_layer_input(dims, PricedKind.LINEAR_ATTENTION):
        x = dims.hidden_tokens(tokens) * dims.geometry.hidden_size * dims.dtype_bytes
        named.insert(0, ("layer input", x))
    return named


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(ROOT / "bench" / "calibration" / "gdn_blocks.md"))
    args = parser.parse_args()
    measured, provider, geometry = measure(args.tokens, args.dtype)
    prices = priced(provider, args.tokens)
    names = [n for n, _ in prices] + [n for n, _ in measured if n not in dict(prices)]
    got, want = dict(measured), dict(prices)
    la = geometry.linear_attention
    lines = [
        "# One Gated DeltaNet layer: kept for backward, priced vs measured",
        "",
        f"Written by `scripts/gdn_blocks.py --tokens {args.tokens} --dtype {args.dtype}`. "
        f"Geometry {geometry.name}: hidden {geometry.hidden_size}, {la.num_key_heads} key "
        f"heads x {la.key_head_dim}, {la.num_value_heads} value heads x {la.value_head_dim}, "
        f"ffn {geometry.ffn_hidden_size}; {args.tokens} tokens, {args.dtype}, LoRA r=8 on "
        "o_proj and the MLP (the GDN linears frozen); CPU kernels of `cpu_gated_delta`. "
        "Measured: storages saved for backward, attributed to the block that first saved "
        "created them (parameters excluded). Priced: the default formulas' kept bytes per block "
        "(`art/trainer_rank/pricing/layers.py`), no recompute; the layer's own output is not kept "
        "by it.",
        "",
        "| block | priced KiB | measured KiB | priced / measured |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        p, m = want.get(name, 0.0), got.get(name, 0)
        ratio = f"{p / m:.3f}" if m else ("-" if not p else "inf")
        lines.append(f"| {name} | {p / 1024:.1f} | {m / 1024:.1f} | {ratio} |")
    tp, tm = sum(want.values()), sum(got.values())
    lines.append(f"| **layer total** | **{tp / 1024:.1f}** | **{tm / 1024:.1f}** | "
                 f"**{tp / max(1, tm):.3f}** |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
