"""One place decides which layouts run: a grid of layouts x implementations x model kinds,
where the provider, the packer, TrainerRank's `layout_refusal` and `plan` give the answer of
art.megatron.runnable_layouts, and that answer is the table written out here."""

from __future__ import annotations

import itertools

import pytest
import torch

from art.megatron import runnable_layouts
from art.megatron.default_layout import default_layout
from art.megatron.geometry import ModelGeometry, load_geometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.megatron.provider import Provider
from art.megatron.runnable_layouts import Asker, LayoutRefusal, LayoutRule
from art.megatron.settings import load_settings
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.cli.planner import plan
from art.trainer_rank.compute.packing import pack_sequences
from art.trainer_rank.decide.runnable import layout_refusal

MODELS = {"dense": "tiny-qwen3", "moe": "tiny-qwen3-moe", "hybrid": "tiny-qwen3_5",
          "hybrid-moe": "tiny-qwen3_5-moe"}
IMPLEMENTATIONS = {"local-unfused": Implementation.cpu_local("unfused"),
                   "local-flash": Implementation.cpu_local("flash"),
                   "cuda-local-flash": Implementation.cuda_local(),
                   "te": Implementation.gpu_te()}
SIZES = (1, 2)


def _geometries() -> dict[str, ModelGeometry]:
    return {kind: load_geometry(name) for kind, name in MODELS.items()}


def _layouts(geometry: ModelGeometry) -> list[ParallelLayout]:
    # Expert parallel on a model with no experts is the provider's sharding check (reported
    # before any layout rule), not a layout rule: the grid spreads experts on MoE models only.
    eps = SIZES if geometry.is_moe else (1,)
    return [ParallelLayout(tensor_parallel=tp, context_parallel=cp, pipeline_parallel=pp,
                           expert_parallel=ep, expert_tensor_parallel=tp)
            for tp, cp, pp, ep in itertools.product(SIZES, SIZES, SIZES, eps)]


def _env(layout: ParallelLayout) -> dict[str, str]:
    return {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": str(layout.tensor_parallel),
            "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": str(layout.context_parallel),
            "ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE": str(layout.pipeline_parallel),
            "ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": str(layout.expert_parallel)}


def _grid() -> list[tuple[str, ModelGeometry, ParallelLayout, str, Implementation]]:
    return [(kind, geometry, layout, impl_name, impl)
            for kind, geometry in _geometries().items()
            for layout in _layouts(geometry)
            for impl_name, impl in IMPLEMENTATIONS.items()]


def _expected(asker: Asker, layout: ParallelLayout, impl: Implementation,
              geometry: ModelGeometry | None) -> LayoutRule | None:
    """The rules as this repository runs them, written out independently of the module."""
    cp = layout.context_parallel > 1
    if asker is Asker.TRAINER_RANK and layout.pipeline_parallel > 1:
        return LayoutRule.PIPELINE_PARALLEL
    if cp and impl.spec == "te" and asker is not Asker.PACKER:
        return LayoutRule.CONTEXT_PARALLEL_THD
    if cp and impl.spec == "local" and impl.attention == "unfused":
        return LayoutRule.CONTEXT_PARALLEL_UNFUSED
    # Every model kind runs under CP (MoE and hybrid MoE included): no rule reads the model.
    return None


def _provider_error(geometry: ModelGeometry, layout: ParallelLayout,
                    impl: Implementation) -> str | None:
    try:
        Provider(geometry, settings=load_settings(_env(layout)), implementation=impl,
                 dtype="float32")
    except ValueError as exc:
        return str(exc)
    return None


def _packer_error(layout: ParallelLayout, impl: Implementation) -> str | None:
    try:
        pack_sequences([torch.arange(1, 6), torch.arange(1, 4)], implementation=impl,
                       layout=layout)
    except ValueError as exc:
        return str(exc)
    return None


def _text(refused: LayoutRefusal | None) -> str | None:
    return None if refused is None else refused.message()


def test_the_one_place_refuses_what_the_table_says_for_every_asker() -> None:
    for kind, geometry, layout, impl_name, impl in _grid():
        for asker in Asker:
            for known in (geometry, None):
                refused = runnable_layouts.refusal(layout, impl, known, asker=asker)
                assert (None if refused is None else refused.rule) == _expected(
                    asker, layout, impl, known), (kind, layout.summary, impl_name, asker)
                if refused is not None:
                    assert refused.remedy in refused.message(), refused
                    assert refused.message().startswith(refused.subject)


def test_the_provider_packer_trainer_rank_and_default_layout_agree_with_the_one_place() -> None:
    for kind, geometry, layout, impl_name, impl in _grid():
        where = (kind, layout.summary, impl_name)
        ask = runnable_layouts.refusal
        assert _provider_error(geometry, layout, impl) == _text(
            ask(layout, impl, geometry, asker=Asker.PROVIDER)), where
        assert _packer_error(layout, impl) == _text(ask(layout, impl, asker=Asker.PACKER)), where
        assert layout_refusal(layout, impl, geometry) == _text(
            ask(layout, impl, geometry, asker=Asker.TRAINER_RANK)), where
        assert layout_refusal(layout, impl) == _text(
            ask(layout, impl, asker=Asker.TRAINER_RANK)), where
    # The default layout spreads a job over the GPUs with CP where the one place runs CP.
    for kind, geometry in _geometries().items():
        chosen = default_layout(load_settings({}), geometry, visible_gpus=2, world_size=2)
        cp2 = ParallelLayout(context_parallel=2)
        runs = runnable_layouts.refusal(cp2, Implementation.cuda_local(), geometry,
                                        asker=Asker.PROVIDER) is None
        assert (chosen.context_parallel_size == 2) == runs, kind


def test_a_flag_named_setting_is_named_in_the_providers_refusal() -> None:
    settings = load_settings({"ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "2"},
                             labels={"ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "--cp"})
    with pytest.raises(ValueError, match=r"^--cp=2 runs in the segmented flash attention"):
        Provider("tiny-qwen3", settings=settings,
                 implementation=Implementation.cpu_local("unfused"))


SENTINEL = LayoutRefusal(LayoutRule.CONTEXT_PARALLEL_UNFUSED, "context_parallel_size",
                         "ART_MEGATRON_CONTEXT_PARALLEL_SIZE=7", ": the one place says no",
                         "ART_MEGATRON_CONTEXT_PARALLEL_SIZE=1")


@pytest.mark.parametrize("answer", [None, SENTINEL], ids=["runs", "refused"])
def test_no_caller_holds_a_rule_of_its_own(monkeypatch: pytest.MonkeyPatch,
                                           answer: LayoutRefusal | None) -> None:
    """With the one place answering the same for every cell, every caller follows it: a
    caller that re-grows a rule refuses a cell the one place lets run, or answers with other
    text."""
    monkeypatch.setattr(runnable_layouts, "refusal", lambda *a, **k: answer)
    expected = _text(answer)
    for kind, geometry, layout, impl_name, impl in _grid():
        where = (kind, layout.summary, impl_name)
        assert _provider_error(geometry, layout, impl) == expected, where
        assert _packer_error(layout, impl) == expected, where
        assert layout_refusal(layout, impl, geometry) == expected, where
    pp2 = ParallelLayout(pipeline_parallel=2)
    batch = MicroBatchShape((256,), outputs=OutputRequest(target_logprobs=True))
    result = plan("tiny-qwen3", batch=batch, gpus=2, gpu_memory_bytes=1 << 30,
                  layouts=[ParallelLayout(), pp2])
    # `plan` marks what TrainerRank refuses and lists what the provider refuses as n/a.
    assert {c.unavailable or c.not_runnable for c in result.cells} == {expected or ""}
