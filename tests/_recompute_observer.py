"""What Megatron really recomputes: which parts of each layer run forward again in backward.

Forward pre-hooks on each layer and its parts, with a phase flag flipped before `backward()`.
A full-recompute unit shows up as its layers re-running ("layer" plus every part); selective
modules as their own part re-running. `expected_reruns` says what `effective_recompute`
predicts in the same labels.
"""

from __future__ import annotations

import torch

from art.megatron.recompute import EffectiveRecompute

NORM_LABELS = {"input": "input_norm", "pre_mlp": "pre_mlp_norm"}


def observe_backward_reruns(
    model: torch.nn.Module, tokens: torch.Tensor
) -> tuple[dict[int, frozenset[str]], list[int]]:
    """Per layer (1-based): the parts whose forward ran again in backward; and the order in
    which whole layers re-ran. Runs one forward and backward of `tokens` [1, s]."""
    counts, order = observe_backward_rerun_counts(model, tokens)
    rerun: dict[int, set[str]] = {}
    for layer_number, label in counts:
        rerun.setdefault(layer_number, set()).add(label)
    return {k: frozenset(v) for k, v in rerun.items()}, order


def observe_backward_rerun_counts(
    model: torch.nn.Module, tokens: torch.Tensor
) -> tuple[dict[tuple[int, str], int], list[int]]:
    """How many times each (layer, part) ran forward again in backward (a part recomputed
    twice, e.g. a selective checkpoint nested in a full one, counts 2)."""
    phase = {"backward": False}
    counts: dict[tuple[int, str], int] = {}
    layer_order: list[int] = []
    handles = []

    def watch(module: torch.nn.Module, layer_number: int, label: str) -> None:
        def hook(*_: object) -> None:
            if phase["backward"]:
                counts[(layer_number, label)] = counts.get((layer_number, label), 0) + 1
                if label == "layer":
                    layer_order.append(layer_number)

        handles.append(module.register_forward_pre_hook(hook))

    for layer in model.decoder.layers:
        n = int(layer.layer_number)
        watch(layer, n, "layer")
        mixer = layer.self_attention
        if hasattr(mixer, "core_attention"):
            watch(mixer.core_attention, n, "core_attn")
            watch(layer.input_layernorm, n, "input_norm")
        else:
            # Gated DeltaNet: no core-attention checkpoint; its input norm is in in_proj.
            watch(mixer, n, "gdn")
            watch(mixer.in_proj, n, "input_norm")
        watch(layer.pre_mlp_layernorm, n, "pre_mlp_norm")
        experts = getattr(layer.mlp, "experts", None)
        watch(experts if experts is not None else layer.mlp, n,
              "moe" if experts is not None else "mlp")
    try:
        positions = torch.arange(tokens.shape[1])[None]
        logits = model(tokens, positions, attention_mask=None)
        phase["backward"] = True
        logits.float().pow(2).mean().backward()
    finally:
        for h in handles:
            h.remove()
    return counts, layer_order


def expected_reruns(er: EffectiveRecompute, moe_layers: tuple[bool, ...]
                    ) -> dict[int, frozenset[str]]:
    """What `observe_backward_reruns` must see under `er`, in its labels."""
    out: dict[int, frozenset[str]] = {}
    for lr in er.layers:
        if lr.full_checkpoint_unit is not None:
            # The whole layer replays, every part with it.
            mlp = "moe" if moe_layers[lr.layer_number - 1] else "mlp"
            mixer = "gdn" if lr.layer_type == "linear_attention" else "core_attn"
            out[lr.layer_number] = frozenset(
                {"layer", mixer, "input_norm", "pre_mlp_norm", mlp})
            continue
        labels: set[str] = set()
        for module in lr.selective_modules:
            if module == "layernorm":
                labels |= {NORM_LABELS[n] for n in lr.recomputed_norms}
            else:
                labels.add(module)
        if labels:
            out[lr.layer_number] = frozenset(labels)
    return out
