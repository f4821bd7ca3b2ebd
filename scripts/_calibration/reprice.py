"""Re-pricing committed calibration rows with the current memory model, without running a
cell: each row's cell rebuilt from its CSV fields, priced by the formulas and by the probe
stored for it (per rank under TP, CP and EP), at its own routing too where it recorded one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _calibration.cells import POLICY_BY_NAME, Cell, calibration_geometries
from _calibration.harness import (
    CalibrationModel,
    cell_sequences,
    cell_world_size,
    default_memory_model,
    expected_probe_key,
    implementation_for,
    micro_batch_shape,
    priced_at_routing,
)

from art.trainer_rank._request import OutputRequest
from art.trainer_rank.measuring.probe_store import probe_file


def cell_of(row: dict[str, Any]) -> Cell:
    """The cell a calibration CSV row measured."""
    return Cell(row["geometry"], row["policy"], int(row["lora_rank"]),
                int(row["tensor_parallel"]),
                tuple(int(n) for n in str(row["lengths"]).split("+")), row["outputs"],
                str(row["grad"]) in ("True", "true", "1"), row.get("dtype") or "float32",
                row.get("loss") or "synthetic", row.get("build") or "local",
                int(row.get("shared_prefix") or 0), int(row.get("deeper") or 0),
                row.get("built_with") or "", int(row.get("context_parallel") or 1),
                int(row.get("expert_parallel") or 1))


def reprice_rows(rows: Sequence[dict[str, Any]], probe_dir: str, *, reprobe: bool = False,
                 probe_tokens: tuple[int, ...] | None = None,
                 progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Re-price measured CSV rows with the current memory model, without running a cell.

    The default column is re-priced from the geometry. The probe column uses the probe stored
    in `probe_dir` under the key the current probe gives the row's model (`expected_probe_key`),
    never a file found under the row's old key: a probe made by another version of the probe
    measures something else. When that file is missing, `reprobe` builds the model and probes
    it again (TP=1; seconds a model, the file is stored for the next re-price); otherwise the
    error says what to do."""
    from art.trainer_rank.measuring.probe import ProbeCoefficients

    cells = [cell_of(r) for r in rows]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, c in enumerate(cells):
        groups.setdefault((c.geometry, c.built_policy, c.lora_rank, c.dtype, c.build,
                           c.tensor_parallel, c.context_parallel, c.expert_parallel),
                          []).append(i)
    out: list[dict[str, Any]] = [dict(r) for r in rows]
    for (geo, policy, rank, dtype, build, tp, cp, ep), indices in groups.items():
        group = [cells[i] for i in indices]
        key = expected_probe_key(group, probe_tokens)
        # TP, CP and EP rows: one probe per rank, each in its rank's folder (`run_cells`).
        ranks = cell_world_size(group[0])
        paths = ([probe_file(probe_dir, key)] if ranks == 1 else
                 [probe_file(Path(probe_dir) / f"rank{r}", key) for r in range(ranks)])
        name = (f"{geo} / {policy} / LoRA r{rank} / TP{tp}{f' CP{cp}' if cp > 1 else ''}"
                f"{f' EP{ep}' if ep > 1 else ''} / {build}")
        if all(p.is_file() for p in paths):
            per_rank = [ProbeCoefficients.from_json(p.read_text()) for p in paths]
        elif reprobe and ranks == 1:
            built = CalibrationModel(calibration_geometries()[geo], POLICY_BY_NAME[policy],
                                     lora_rank=rank, tensor_parallel=tp, dtype=dtype,
                                     cells=group, probe_tokens=probe_tokens,
                                     probe_dir=probe_dir,
                                     implementation=implementation_for(build))
            per_rank = [built.coefficients]
            del built
            if progress:
                progress(f"re-probed {name}: probe {per_rank[0].key}")
        else:
            old = sorted({str(rows[i].get("probe_key", "")) for i in indices})
            remedy = ("pass --reprobe to measure the probe again (seconds a model; no cell "
                      "is re-run)" if ranks == 1 else
                      "TP>1 probes run on torchrun ranks and are stored per rank by "
                      "scripts/calibrate.py --tp 2 (<out>/probes/rank<R>): re-measure these "
                      "rows with it")
            raise ValueError(
                f"no stored probe for {name} under key {key} in {probe_dir} (the rows were "
                f"priced by probe {', '.join(old)}: another probe version or other inputs, "
                f"or a probe never stored); {remedy}")
        for path, coefficients in zip(paths, per_rank, strict=True):
            if coefficients.key != key:
                raise ValueError(f"{path} holds probe {coefficients.key}, expected {key}: the "
                                 "file was renamed or the probe's key computation changed")
        for i in indices:
            out[i] = _reprice(out[i], cells[i], per_rank)
    return out


def _reprice(row: dict[str, Any], cell: Cell, per_rank: Sequence[Any]) -> dict[str, Any]:
    """Both columns of a measured row with the current model; a TP row's probe column is
    the highest estimate over its ranks' probes (as `merge_rank_rows` prices it)."""
    model = default_memory_model(cell)
    batch = micro_batch_shape(cell.lengths, OutputRequest.parse(cell.outputs), cell.grad,
                              model.layout, model.implementation,
                              cell_sequences(cell, model.geometry.vocab_size))
    default = model.estimate(batch)
    estimates = [model.with_coefficients(c).estimate(batch) for c in per_rank]
    est = max(estimates, key=lambda e: max(e.forward_peak_bytes, e.backward_peak_bytes))
    coefficients = per_rank[estimates.index(est)]
    predicted_default = max(default.forward_peak_bytes, default.backward_peak_bytes)
    predicted = max(est.forward_peak_bytes, est.backward_peak_bytes)
    measured = max(1, int(row["measured_bytes"]))
    if row.get("own_routing"):
        shares = [float(x) for x in str(row["own_routing"]).split("/")]
        own = max(priced_at_routing(model.with_coefficients(c), shares, batch)
                  for c in per_rank)
        own_default = priced_at_routing(model, shares, batch)
        row = row | {"own_routing_bytes": own,
                     "own_routing_ratio": round(own / measured, 4),
                     "own_routing_default_bytes": own_default,
                     "own_routing_default_ratio": round(own_default / measured, 4)}
    return row | {"predicted_bytes": predicted,
                  "predicted_default_bytes": predicted_default,
                  "ratio": round(predicted / measured, 4),
                  "default_ratio": round(predicted_default / measured, 4),
                  "peak_at": est.peak_at, "probe_key": coefficients.key}
