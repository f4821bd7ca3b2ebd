#!/usr/bin/env python
"""Print many memory-model estimates to one text file, to show a refactor changes no price.

    .venv/bin/python scripts/price_snapshot.py /tmp/before.txt
    (change the code)
    .venv/bin/python scripts/price_snapshot.py /tmp/after.txt && cmp /tmp/before.txt /tmp/after.txt

Every shipped geometry x recompute policy x implementation x TP 1/2 x coefficients (the
formulas, and each probe file stored in bench/calibration/probes) x micro-batch x outputs x
grad / no grad: the full term table, where the peak is, and the dynamic bytes. No model is
built; a run takes a minute or two.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from art.megatron.geometry import load_geometry  # noqa: E402
from art.megatron.implementation import Implementation  # noqa: E402
from art.megatron.layout import ParallelLayout  # noqa: E402
from art.megatron.recompute import resolve_recompute  # noqa: E402
from art.trainer_rank._request import LoraShape, MicroBatchShape, OutputRequest  # noqa: E402
from art.trainer_rank.measuring.probe import ProbeCoefficients  # noqa: E402
from art.trainer_rank.pricing.model import MemoryModel  # noqa: E402

# (granularity, method, num_layers, selective modules)
POLICIES = (
    ("full", "uniform", 1, None),
    ("full", "uniform", 2, None),
    ("full", "block", 1, None),
    ("selective", None, None, ("core_attn",)),
    ("selective", None, None, ("mlp", "layernorm")),
    (None, None, None, None),
)
LENGTHS = ((100,), (2000, 3000), (16355, 16355))
OUTPUTS = ("logprobs", "hidden_states", "logprobs,top_k=5,logits")


def snapshot() -> list[str]:
    implementations = (Implementation.gpu_te(), Implementation.cpu_local(),
                       Implementation.cpu_local("flash"))
    probes = [ProbeCoefficients.from_json(p.read_text())
              for p in sorted((ROOT / "bench" / "calibration" / "probes").glob("*.json"))]
    names = sorted(p.stem for p in (ROOT / "art" / "megatron" / "model_configs").glob("*.json"))
    lines: list[str] = []
    for name in names:
        geometry = load_geometry(name)
        for implementation, policy, tp in itertools.product(implementations, POLICIES, (1, 2)):
            granularity, method, num_layers, modules = policy
            head = f"{name} {implementation.key} {policy} TP{tp}"
            try:
                recompute = resolve_recompute(
                    granularity=granularity, method=method, num_layers=num_layers,
                    modules=modules, moe_layers=geometry.moe_layers,
                    layer_types=geometry.layer_types,
                    norm_fused_into_linear=implementation.norm_fused_into_linear)
            except ValueError as exc:
                lines.append(f"{head}: {exc}")
                continue
            for coefficients in (None, *probes):
                model = MemoryModel(
                    geometry, layout=ParallelLayout(tensor_parallel=tp, sequence_parallel=tp > 1,
                                                    expert_tensor_parallel=tp),
                    recompute=recompute, implementation=implementation,
                    lora=LoraShape(8, ("linear_qkv", "linear_fc1")), dtype="bfloat16",
                    coefficients=coefficients)
                for lengths, outputs, grad in itertools.product(LENGTHS, OUTPUTS, (True, False)):
                    batch = MicroBatchShape(lengths, outputs=OutputRequest.parse(outputs),
                                            grad_enabled=grad)
                    where = f"{head} {coefficients and coefficients.key} {lengths} {outputs} {grad}"
                    try:
                        estimate = model.estimate(batch)
                    except ValueError as exc:
                        lines.append(f"{where}: {exc}")
                        continue
                    lines.append(f"{where}\n{estimate.table()}\n{estimate.peak_at} "
                                 f"{estimate.dynamic_bytes}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="text file to write")
    args = parser.parse_args()
    lines = snapshot()
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} estimates written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
