"""torchrun worker (gloo, 2 ranks): the attention + MoE calibration model at EP=2 under
routings the worker chooses, each micro-batch measured and priced at the shares its own
forward routed at (the harness's `own_routing` column), and at what pricing one share for all
three moments would give.

The routers are replaced by a deterministic routing (`skewed_map`): in MoE layer i a
fraction `to_rank0[i]` of the tokens goes to EP rank 0's experts, the rest to rank 1's; within
a rank each token's top-k experts are consecutive among `busy[i]` of its local experts. Two
routings:
- `layers`: the last MoE layer sends 70% of its tokens to rank 0, the others half: rank 0's
  experts work at 1.4x the even share in that layer and hold 1.1x of it on average over the
  layers (the last layer, whose moment without grad sits on the most held routing state, is
  the one a summary of shares must assume busiest: it prices every layer's moment at the
  working share);
- `experts`: every layer even between the ranks, each rank's pairs on two of its four
  experts: the busiest expert takes 2x the even count per expert.

Writes out_dir/result.json on rank 0: per routing and cell, the measured peak (the busier
rank's), the price at its own routing, and the price at one share for all three moments
(working for the `layers` routing, the even share for the `experts` routing).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

ROUTINGS = {
    "layers": {"to_rank0": (0.5, 0.5, 0.5, 0.7), "busy": (4, 4, 4, 4)},
    "experts": {"to_rank0": (0.5, 0.5, 0.5, 0.5), "busy": (2, 2, 2, 2)},
}
# Each routing's micro-batches, (lengths, grad): the moments its shares set. With grad the
# peak comes after the forward, every layer's experts' pairs held (the held share); without
# grad it is a layer's last expert at work (the busiest expert's share).
ROWS = {
    "layers": (((600,), True), ((250, 350), True)),
    "experts": (((300,), False), ((40, 90, 170), False)),
}


def skewed_map(self, logits: torch.Tensor, padding_mask=None):
    """`TopKRouter.routing` for this worker's routings (see the module docstring); the
    router's scores (softmax) kept on the chosen experts as the probabilities."""
    logits = logits.view(-1, self.config.num_moe_experts)
    tokens, experts = logits.shape
    layer = self.moe_layer_index
    fraction, busy = self.skew["to_rank0"][layer], self.skew["busy"][layer]
    local = experts // 2
    t = torch.arange(tokens, device=logits.device)
    # Token t goes to rank 0 when floor((t + 1) f) > floor(t f): a fraction f of any row.
    to_rank0 = (t.double() * fraction).floor() != ((t + 1).double() * fraction).floor()
    # The j-th token a rank takes goes to its experts j*k .. j*k+k-1 modulo `busy`.
    j = torch.where(to_rank0, to_rank0.cumsum(0), (~to_rank0).cumsum(0)) - 1
    first = torch.where(to_rank0, 0, local)
    index = first.unsqueeze(1) + (j.unsqueeze(1) * self.topk
                                  + torch.arange(self.topk, device=logits.device)) % busy
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, index, True)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32) * routing_map
    return probs.type_as(logits), routing_map


def main(out_dir: str) -> None:
    from _calibration.cells import POLICY_BY_NAME, Cell, calibration_geometries
    from _calibration.harness import CalibrationModel, micro_batch_shape, priced_at_routing

    from art.trainer_rank._request import OutputRequest
    from art.trainer_rank.measuring.routing import moe_routers

    def cell(lengths: tuple[int, ...], grad: bool) -> Cell:
        return Cell("moe-128", "selective default", 8, 1, lengths, "logprobs", grad,
                    expert_parallel=2)

    cells = {name: [cell(*row) for row in rows] for name, rows in ROWS.items()}
    model = CalibrationModel(calibration_geometries()["moe-128"],
                             POLICY_BY_NAME["selective default"], lora_rank=8,
                             tensor_parallel=1, expert_parallel=2,
                             cells=[c for group in cells.values() for c in group])
    routers = moe_routers(model.model)
    results: dict[str, list[dict]] = {}
    for name, skew in ROUTINGS.items():
        for index, router in enumerate(routers):
            router.moe_layer_index, router.skew = index, skew
            router.routing = types.MethodType(skewed_map, router)
        rows = []
        for cell in cells[name]:
            result = model.measure(cell)
            working, held, expert = result.own_routing
            one_share = ((working, working, working) if name == "layers" else (1.0, 1.0, 1.0))
            batch = micro_batch_shape(cell.lengths, OutputRequest.parse(cell.outputs),
                                      cell.grad, model.layout, model.implementation)
            rows.append({"cell": f"{cell.lengths} {'grad' if cell.grad else 'no grad'}",
                         "measured": result.measured_bytes, "own": result.own_routing_bytes,
                         "one_share": priced_at_routing(model.memory, one_share, batch),
                         "routing": result.own_routing, "peak_at": result.peak_at})
        results[name] = rows
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = {name: [max(ranks, key=lambda r: r["measured"]) | {
            "own": max(r["own"] for r in ranks), "one_share": max(r["one_share"] for r in ranks)}
            for ranks in zip(*(g[name] for g in gathered), strict=True)]
            for name in ROUTINGS}
        Path(out_dir, "result.json").write_text(json.dumps(merged))


if __name__ == "__main__":
    main(sys.argv[1])
