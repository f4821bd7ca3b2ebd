"""scripts/calibrate.py's TP=2 matrix: which cells a run with --geometries measures, and the
layout its MoE cells are built with (no model is built here)."""

from __future__ import annotations

import calibrate
from _calibration.cells import HYBRID_GEOMETRIES, off_grid_matrix
from _calibration.harness import calibration_geometries, calibration_provider

from art.megatron.implementation import Implementation
from art.megatron.recompute import RecomputePolicy


def test_tp2_matrix_keeps_the_dense_subset_and_adds_the_hybrids_asked_for() -> None:
    dense = off_grid_matrix(1, rows_per_model=4, tensor_parallel=2,
                            geometries=(calibrate.TP2_GEOMETRY,),
                            policies=calibrate.TP2_POLICIES, max_tokens=3000)
    # Without --geometries (and with gqa-128 named) the dense rows are those of earlier runs.
    assert calibrate.tp2_cells(False, 0) == dense
    assert calibrate.tp2_cells(False, 0, geometries=["gqa-128"]) == dense
    assert not calibrate.tp2_wanted(["gqa-256"]) and calibrate.tp2_wanted(["hybrid-moe-128"])
    hybrids = calibrate.tp2_cells(False, 0, geometries=list(HYBRID_GEOMETRIES))
    assert {c.geometry for c in hybrids} == set(HYBRID_GEOMETRIES)
    assert {c.policy for c in hybrids} == set(calibrate.TP2_POLICIES)
    # Rows a multiple of TP (sequence parallel pads none); a group's row holds its prompt once.
    assert all(c.tensor_parallel == 2 and (
        sum(c.lengths) - c.shared_prefix * (len(c.lengths) - 1) - c.deeper) % 2 == 0
        for c in hybrids)
    assert any(c.shared_prefix for c in hybrids)
    # One hybrid alone gets its rows of the two-hybrid matrix (one seeded family).
    moe = calibrate.tp2_cells(False, 0, geometries=["hybrid-moe-128"])
    assert moe == [c for c in hybrids if c.geometry == "hybrid-moe-128"]
    both = calibrate.tp2_cells(False, 0, geometries=["gqa-128", "hybrid-128"])
    assert both[:len(dense)] == dense and len(both) > len(dense)


def test_moe_cells_at_tp2_use_sequence_parallel() -> None:
    """Megatron-Core's MoE layer refuses to train with TP > 1 and no sequence parallel."""
    policy = RecomputePolicy("none", None)
    geometries = calibration_geometries()
    for name, tp, expected in (("hybrid-moe-128", 2, True), ("hybrid-moe-128", 1, False),
                               ("hybrid-128", 2, False), ("gqa-128", 2, False)):
        provider = calibration_provider(geometries[name], policy, lora_rank=8,
                                        tensor_parallel=tp, dtype="float32",
                                        implementation=Implementation.cpu_local())
        assert provider.settings.sequence_parallel is expected, (name, tp)


def test_the_ep2_matrix_is_the_moe_model_at_tp1_x_ep2() -> None:
    """calibrate.py --ep 2: its cells, their what-if layout and a CSV row's round trip (the
    measured matrix is bench/calibration/ep2, two torchrun ranks)."""
    from _calibration.harness import default_memory_model
    from _calibration.reprice import cell_of

    cells = calibrate.ep2_cells(False, 0)
    assert cells and {c.geometry for c in cells} == set(calibrate.EP2_GEOMETRIES)
    assert {(c.tensor_parallel, c.context_parallel, c.expert_parallel) for c in cells} == {
        (1, 1, 2)}
    assert {c.policy for c in cells} == set(calibrate.TP2_POLICIES)
    assert any(c.shared_prefix for c in cells)
    layout = default_memory_model(cells[0]).layout
    assert (layout.expert_parallel, layout.data_parallel, layout.tensor_parallel) == (2, 2, 1)
    row = {k: (v if k != "lengths" else "+".join(map(str, v)))
           for k, v in cells[0].__dict__.items()}
    assert cell_of(row) == cells[0]
