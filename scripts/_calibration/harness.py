"""Calibration harness: real Megatron-Core models, real micro-batches, measured vs predicted.

One cell = one (geometry, recompute policy, LoRA rank, layout) model and one micro-batch
(packed lengths, outputs, grad). It runs exactly the trainer's compute path: P's
`pack_sequences` -> `decoder_hidden_states` -> `compute_heads` -> the caller loss
(the cell's, `losses.py`) -> backward, inside the memory meter (`measuring/meter.py`), starting
from the state before the micro-batch (weights, LoRA grads and optimizer state already live;
Megatron's attention score buffer cleared, so the micro-batch pays for it as a first call would).

The comparison is on the dynamic part: measured = peak of bytes allocated inside the
micro-batch; predicted = max(forward peak, backward peak) of the estimate, i.e. the dynamic
figure without the allocator reserve (the reserve is a margin for fragmentation on GPU, not a
prediction of allocated bytes; it is reported alongside).
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from _calibration.cells import (
    POLICY_BY_NAME,
    Cell,
    Policy,
    calibration_geometries,
    lora_targets_for,
)
from _calibration.losses import LOSS_BY_NAME

from art.megatron.geometry import ModelGeometry
from art.megatron.implementation import Implementation
from art.megatron.layout import ParallelLayout
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.compute.forward import unwrap_model
from art.trainer_rank.measuring.meter import MemoryMeter, release_score_buffer
from art.trainer_rank.measuring.probe import modes_for, probe
from art.trainer_rank.measuring.probe_store import store_probe
from art.trainer_rank.measuring.routing import router_counts, row_routing
from art.trainer_rank.pricing.coefficients import LayerMode
from art.trainer_rank.pricing.model import MemoryModel
from art.trainer_rank.pricing.row_changes import ANY_ROW_TOKENS, ExpertShare


@dataclass
class CellResult:
    cell: Cell
    measured_bytes: int
    measured_forward_bytes: int
    predicted_bytes: int  # max(forward, backward) of the estimate with probe coefficients
    predicted_default_bytes: int  # the same with default (formula) coefficients
    reserve_bytes: int
    peak_at: str
    probe_key: str
    seconds: float
    # Under expert parallel: the shares the row's own forward routed at (`row_routing`:
    # working, held, expert) and the estimate priced at them, apart from the router's spread
    # the price itself covers.
    own_routing: tuple[float, float, float] | None = None
    own_routing_bytes: int | None = None
    own_routing_default_bytes: int | None = None  # the formulas priced at those shares

    @property
    def ratio(self) -> float:
        return self.predicted_bytes / max(1, self.measured_bytes)

    @property
    def default_ratio(self) -> float:
        return self.predicted_default_bytes / max(1, self.measured_bytes)

    def row(self) -> dict[str, Any]:
        c = asdict(self.cell)
        c["lengths"] = "+".join(str(n) for n in self.cell.lengths)
        c["packed_tokens"] = (sum(self.cell.lengths) if not self.cell.shared_prefix else
                              sum(self.cell.lengths)
                              - self.cell.shared_prefix * (len(self.cell.lengths) - 1)
                              - self.cell.deeper)
        return c | {
            "measured_bytes": self.measured_bytes,
            "measured_forward_bytes": self.measured_forward_bytes,
            "predicted_bytes": self.predicted_bytes,
            "predicted_default_bytes": self.predicted_default_bytes,
            "ratio": round(self.ratio, 4),
            "default_ratio": round(self.default_ratio, 4),
            "reserve_bytes": self.reserve_bytes,
            "peak_at": self.peak_at,
            "probe_key": self.probe_key,
            "seconds": round(self.seconds, 2),
        } | ({} if self.own_routing is None else {
            "own_routing": "/".join(f"{x:.6f}" for x in self.own_routing),
            "own_routing_bytes": self.own_routing_bytes,
            "own_routing_ratio": round(self.own_routing_bytes / max(1, self.measured_bytes), 4),
            "own_routing_default_bytes": self.own_routing_default_bytes,
            "own_routing_default_ratio": round(
                (self.own_routing_default_bytes or 0) / max(1, self.measured_bytes), 4),
        })


class CalibrationModel:
    """One built model (provider path, LoRA applied) and its memory model with probe."""

    def __init__(self, geometry: ModelGeometry, policy: Policy, *, lora_rank: int,
                 tensor_parallel: int, dtype: str = "float32",
                 implementation: Implementation | None = None, context_parallel: int = 1,
                 expert_parallel: int = 1, cells: Sequence[Cell] = (),
                 probe_tokens: tuple[int, ...] | None = None,
                 probe_dir: str | None = None,
                 warm_up: Callable[[CalibrationModel], None] | None = None
                 ) -> None:
        """`warm_up`: called once the model is built, before the probe (e.g. the GPU check's
        unmeasured micro-batches, so kernels compile and autotune outside any measurement)."""
        self.geometry = geometry
        self.policy = policy
        self.implementation = implementation or Implementation.detect(context_parallel)
        self.provider = calibration_provider(geometry, policy, lora_rank=lora_rank,
                                             tensor_parallel=tensor_parallel, dtype=dtype,
                                             implementation=self.implementation,
                                             context_parallel=context_parallel,
                                             expert_parallel=expert_parallel)
        self.provider.initialize_distributed()
        self.model = self.provider.build_model(seed=0)
        self.device = next(self.model.parameters()).device
        self.layout: ParallelLayout = self.provider.layout
        self.memory_default = MemoryModel.for_provider(self.provider)
        self._warm_grads()
        if warm_up is not None:
            warm_up(self)
        from art.megatron.recompute_ladder import build_ladder

        self.ladder = build_ladder(self.provider.effective_recompute,
                                   self.provider.recompute_as)
        modes, outputs = probe_request(geometry, [self.recompute_for(c) for c in cells]
                                       or [self.provider.effective_recompute], cells)
        self.coefficients = probe(
            self.model, geometry=geometry, layout=self.layout,
            implementation=self.implementation, dtype=dtype, lora_rank=lora_rank,
            modes=modes, outputs=outputs, tokens=probe_tokens, cache_dir=probe_dir,
        )
        self.memory = self.memory_default.with_coefficients(self.coefficients)

    def recompute_for(self, cell: Cell) -> Any:
        """The per-layer policy `cell` runs: the built one, or the rung it switches on."""
        if not cell.built_with:
            return self.provider.effective_recompute
        return rung_by_name(self.ladder, cell.policy)

    def _warm_grads(self) -> None:
        """One small step so LoRA grads exist before any measured micro-batch (resident)."""
        cell_outputs = OutputRequest(target_logprobs=True)
        run_micro_batch(self.model, [16], cell_outputs, True, self.layout, self.implementation,
                        self.device)

    def measure(self, cell: Cell, seed: int = 0, *, observe_allocations: bool = True
                ) -> CellResult:
        """`observe_allocations=False`: on CUDA read the allocator only, as TrainerRank's own
        meter does there (see `run_micro_batch`)."""
        outputs = OutputRequest.parse(cell.outputs)
        start = time.perf_counter()
        torch.manual_seed(seed)
        sequences = cell_sequences(cell, self.geometry.vocab_size, self.device)
        recompute = self.recompute_for(cell)
        memory, memory_default = self.memory, self.memory_default
        switch: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if cell.built_with:
            from art.trainer_rank.decide.escalation import running_recompute

            switch = running_recompute(self.model, recompute)
            memory = memory.with_recompute(recompute)
            memory_default = memory_default.with_recompute(recompute)
        routed = (router_counts(unwrap_model(self.model)) if self.layout.expert_parallel > 1
                  else contextlib.nullcontext([]))
        with switch, routed as counts:
            measured, measured_forward = run_micro_batch(
                self.model, cell.lengths, outputs, cell.grad, self.layout, self.implementation,
                self.device, loss_name=cell.loss, sequences=sequences,
                observe_allocations=observe_allocations)
        batch = micro_batch_shape(cell.lengths, outputs, cell.grad, self.layout,
                                  self.implementation, sequences)
        est = memory.estimate(batch)
        default = memory_default.estimate(batch)
        own = own_bytes = own_default_bytes = None
        if counts:
            share = row_routing(counts, sum(self.geometry.moe_layers), batch.packed_tokens,
                                self.layout)
            own = (share.working, share.held, share.expert)
            own_bytes = priced_at_routing(memory, own, batch)
            own_default_bytes = priced_at_routing(memory_default, own, batch)
        return CellResult(
            cell=cell, measured_bytes=measured, measured_forward_bytes=measured_forward,
            predicted_bytes=max(est.forward_peak_bytes, est.backward_peak_bytes),
            predicted_default_bytes=max(default.forward_peak_bytes, default.backward_peak_bytes),
            reserve_bytes=est.reserve_bytes, peak_at=est.peak_at,
            probe_key=self.coefficients.key,
            seconds=time.perf_counter() - start,
            own_routing=own, own_routing_bytes=own_bytes,
            own_routing_default_bytes=own_default_bytes,
        )


def priced_at_routing(memory: MemoryModel, shares: Sequence[float],
                      batch: MicroBatchShape) -> int:
    """The peak `memory` prices `batch` at when its MoE layers route at `shares` (working,
    held, expert) whatever the row's length: in place of the probe's measured spread, or
    as the formulas' assumed one (`expert_load`) when `memory` has no probe."""
    at = ExpertShare(ANY_ROW_TOKENS, *shares)
    priced = (replace(memory, expert_load=at) if memory.coefficients is None else
              memory.with_coefficients(replace(memory.coefficients,
                                               expert_routing_shares=(at,))))
    est = priced.estimate(batch)
    return max(est.forward_peak_bytes, est.backward_peak_bytes)


def calibration_provider(geometry: ModelGeometry, policy: Policy, *, lora_rank: int,
                         tensor_parallel: int, dtype: str, implementation: Implementation,
                         context_parallel: int = 1, expert_parallel: int = 1) -> Any:
    """The provider a calibration model is built from (no weights yet). peft is imported
    only for a LoRA (its import alone takes seconds; the GPU check prices without one)."""
    from art.megatron.provider import Provider
    from art.megatron.settings import Settings

    settings = Settings(
        tensor_model_parallel_size=tensor_parallel,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        # Whole experts on each EP rank (expert TP 1), as the what-if layout prices them: at
        # TP=2 x EP=2 the two TP ranks are the EP group.
        expert_tensor_parallel_size=1 if expert_parallel > 1 else None,
        sequence_parallel=calibration_sequence_parallel(geometry, tensor_parallel),
        recompute_granularity=policy.granularity,
        recompute_method=policy.method,
        recompute_num_layers=policy.num_layers,
        recompute_modules=policy.modules,
    )
    lora = None
    if lora_rank:
        from peft import LoraConfig

        lora = LoraConfig(r=lora_rank, lora_alpha=lora_rank,
                          target_modules=list(lora_targets_for(geometry)), lora_dropout=0.0)
    return Provider(geometry, settings=settings, lora=lora, dtype=dtype,
                    implementation=implementation)


def calibration_sequence_parallel(geometry: ModelGeometry, tensor_parallel: int) -> bool:
    """Sequence parallel only where Megatron-Core requires it (MoE layers with TP > 1 refuse to
    train without it); the dense cells keep the plain TP layout they always measured."""
    return tensor_parallel > 1 and geometry.is_moe


def probe_request(geometry: ModelGeometry, recomputes: Sequence[Any], cells: Sequence[Cell]
                  ) -> tuple[set[LayerMode], set[tuple[OutputRequest, bool]]]:
    """What a model's probe measures for its cells: the layer modes of every policy they run,
    and (outputs, grad) tails."""
    outputs = {(OutputRequest.parse(c.outputs), c.grad) for c in cells}
    grads = {g for _, g in outputs} or {True}
    modes = {m for recompute in recomputes for g in grads
             for m in modes_for(geometry, recompute, g)}
    return modes, outputs


def rung_by_name(rungs: Sequence[Any], name: str) -> Any:
    """The per-layer policy of the ladder rung called `name`."""
    for rung in rungs:
        if rung.name == name:
            return rung.recompute
    raise ValueError(f"no recompute rung {name!r} for this model; rungs: "
                     f"{', '.join(r.name for r in rungs)}")


def expected_probe_key(cells: Sequence[Cell], probe_tokens: tuple[int, ...] | None = None
                       ) -> str:
    """The probe key the model of `cells` (one geometry, policy, rank, dtype, build and TP
    size) gets from the current probe, computed without building it. The calibration runs
    one process per TP rank, so the world size is the TP size."""
    from art.trainer_rank.measuring.probe import probe_key

    first = cells[0]
    geometry = calibration_geometries()[first.geometry]
    implementation = (implementation_for(first.build)
                      or Implementation.detect(first.context_parallel))
    provider = calibration_provider(geometry, POLICY_BY_NAME[first.built_policy],
                                    lora_rank=first.lora_rank,
                                    tensor_parallel=first.tensor_parallel, dtype=first.dtype,
                                    implementation=implementation,
                                    context_parallel=first.context_parallel,
                                    expert_parallel=first.expert_parallel)
    recomputes = [provider.effective_recompute]
    if any(c.built_with for c in cells):
        from art.megatron.recompute_ladder import build_ladder

        ladder = build_ladder(provider.effective_recompute, provider.recompute_as)
        recomputes = [rung_by_name(ladder, c.policy) if c.built_with
                      else provider.effective_recompute for c in cells]
    modes, outputs = probe_request(geometry, recomputes, cells)
    return probe_key(geometry=geometry,
                     layout=provider.settings.layout(cell_world_size(first)),
                     implementation=implementation, dtype=first.dtype,
                     lora_rank=first.lora_rank, modes=modes, outputs=outputs,
                     device=implementation.device, tokens=probe_tokens)


def cell_world_size(cell: Cell) -> int:
    """The ranks a cell runs on: its TP x CP group, or its EP group where that is larger
    (expert parallel spans the data-parallel ranks)."""
    return max(cell.tensor_parallel * cell.context_parallel, cell.expert_parallel)


def cell_sequences(cell: Cell, vocab: int, device: torch.device | str = "cpu"
                   ) -> list[torch.Tensor] | None:
    """A shared-prefix cell's sequences, the same on every call (a generator seeded by the
    cell): the prompt, the deeper part for the first two, then each one's own tokens, whose
    first token differs from every other's, so the tree is the one the cell describes. None
    for a cell without a shared prefix (its tokens do not change its memory)."""
    if not cell.shared_prefix:
        return None
    g = torch.Generator().manual_seed(zlib.crc32(repr(cell).encode()))
    prompt = torch.randint(1, vocab, (cell.shared_prefix,), generator=g)
    deeper = torch.randint(1, vocab, (cell.deeper,), generator=g)
    if cell.deeper:
        deeper[0] = 0  # no sequence's own part starts with token 0
    sequences = []
    for k, n in enumerate(cell.lengths):
        before = cell.shared_prefix + (cell.deeper if k < 2 else 0)
        own = torch.randint(1, vocab, (n - before,), generator=g)
        own[0] = 1 + k % (vocab - 1)
        parts = [prompt, deeper, own] if k < 2 and cell.deeper else [prompt, own]
        sequences.append(torch.cat(parts).to(device))
    return sequences


def micro_batch_shape(lengths: Sequence[int], outputs: OutputRequest, grad: bool,
                      layout: ParallelLayout, implementation: Implementation,
                      sequences: Sequence[torch.Tensor] | None = None) -> MicroBatchShape:
    """The shape the trainer's admission prices; with `sequences` (one group sharing their
    prefixes) its packed row and recurrent segments as the packer lays them out."""
    from art.trainer_rank._request import RecurrentRow
    from art.trainer_rank.compute.packing import packed_length_tokens, shares_prefixes
    from art.trainer_rank.compute.prefix_tree import tree_shape

    recurrent = None
    shared = 0
    if sequences is not None and shares_prefixes(implementation, layout):
        tree = tree_shape(list(sequences))
        shared = sum(lengths) - sum(tree.segment_lengths_tokens)
        if tree.continued_segments:
            recurrent = RecurrentRow(tree.levels)
    total = sum(lengths)
    padded = packed_length_tokens(lengths, layout, shared, implementation)
    return MicroBatchShape(tuple(lengths), outputs=outputs, grad_enabled=grad,
                           padded_tokens=padded if padded != total else 0, recurrent=recurrent)


def run_micro_batch(model: Any, lengths: Sequence[int], outputs: OutputRequest, grad: bool,
                    layout: ParallelLayout, implementation: Implementation,
                    device: torch.device, loss_name: str = "synthetic",
                    sequences: Sequence[torch.Tensor] | None = None,
                    observe_allocations: bool = True) -> tuple[int, int]:
    """(peak, forward peak) bytes allocated by one micro-batch on the trainer's path;
    `sequences`: one group whose shared prefixes are laid out once, run as the trainer runs
    it (`run_sub_forward`: per-sequence outputs, the caller's loss summed over them); else
    random tokens of `lengths`, each sequence alone, with the loss over the packed row.
    `observe_allocations=False` (CUDA): the meter reads the allocator without its dispatch
    observer, as TrainerRank's meter does on a GPU; under the observer torch.compile'd
    functions (Megatron's jit_fuser) run eagerly, since Dynamo skips frames while a non-infra
    TorchDispatchMode is active. CPU meters always observe."""
    from art.trainer_rank.compute.forward import decoder_hidden_states, unwrap_model
    from art.trainer_rank.compute.heads import HeadOutputs, compute_heads
    from art.trainer_rank.compute.packing import pack_sequences

    if sequences is not None:
        return _run_shared_group(model, sequences, outputs, grad, layout, implementation,
                                 device, loss_name, observe_allocations)
    inner = unwrap_model(model)
    sequences = [torch.randint(0, inner.vocab_size, (n,), device=device) for n in lengths]
    release_score_buffer()
    meter = MemoryMeter(device=device, largest_on_cuda=observe_allocations)
    with meter:
        batch = pack_sequences(sequences, implementation=implementation, layout=layout,
                               device=device)
        targets = batch.tokens[0].roll(-1)
        with torch.set_grad_enabled(grad):
            hidden = decoder_hidden_states(model, batch)
            # As the trainer's path does: the head runs only when a head output is wanted.
            heads = HeadOutputs(None, None, None, None)
            if outputs.uses_head:
                heads = compute_heads(
                    model, hidden, target_tokens=targets if outputs.target_logprobs else None,
                    top_k=outputs.top_k, logits=outputs.logits)
            loss = LOSS_BY_NAME[loss_name](outputs, heads, hidden) if grad else None
        forward_peak = _forward_peak_then_backward(meter, loss)
        del loss, heads, hidden, batch
    return int(meter.peak_bytes), int(forward_peak)


def _forward_peak_then_backward(meter: MemoryMeter, loss: torch.Tensor | None) -> int:
    """The micro-batch's forward peak so far, then the caller's backward (None: no grad)."""
    meter.synchronize()
    forward_peak = meter.peak_bytes
    if loss is not None:
        loss.backward()
    meter.synchronize()
    return forward_peak


def _run_shared_group(model: Any, sequences: Sequence[torch.Tensor], outputs: OutputRequest,
                      grad: bool, layout: ParallelLayout, implementation: Implementation,
                      device: torch.device, loss_name: str,
                      observe_allocations: bool = True) -> tuple[int, int]:
    """One group sharing its prefixes through the trainer's sub-forward: each sequence gets
    its own outputs (copies of its rows, as `unpack` gathers them on a shared row), and
    the caller's loss is the sum of its loss on each sequence's outputs."""
    from art.trainer_rank._types import ForwardInput
    from art.trainer_rank.compute.execute import run_sub_forward
    from art.trainer_rank.compute.heads import HEAD_CHUNK_TOKENS, HeadOutputs

    leaves = [ForwardInput(
        input_tokens=tokens,
        target_tokens=tokens.roll(-1) if outputs.target_logprobs else None,
        top_k=outputs.top_k or None, logits=outputs.logits,
        hidden_states=outputs.hidden_states) for tokens in sequences]
    release_score_buffer()
    meter = MemoryMeter(device=device, largest_on_cuda=observe_allocations)
    with meter:
        with torch.set_grad_enabled(grad):
            per_sequence = run_sub_forward(
                model, leaves, implementation=implementation, layout=layout, device=device,
                head_chunk_tokens=HEAD_CHUNK_TOKENS, groups=[len(leaves)])
            loss = sum(LOSS_BY_NAME[loss_name](outputs, HeadOutputs(
                out.target_logprobs,
                None if out.top_k is None else out.top_k.logprobs,
                None if out.top_k is None else out.top_k.tokens,
                out.logits), _hidden_or_any(out)) for out in per_sequence) if grad else None
        forward_peak = _forward_peak_then_backward(meter, loss)
        del loss, per_sequence
    return int(meter.peak_bytes), int(forward_peak)


def _hidden_or_any(out: Any) -> torch.Tensor:
    """The hidden states the loss reads (it reads them only when they were asked for; any
    other output stands in for the device and dtype of its zero)."""
    for tensor in (out.hidden_states, out.target_logprobs, out.logits,
                   None if out.top_k is None else out.top_k.logprobs):
        if tensor is not None:
            return tensor
    raise ValueError("a calibration cell with grad must ask for at least one output")


def run_cells(cells: Iterable[Cell], *, tensor_parallel: int = 1, context_parallel: int = 1,
              expert_parallel: int = 1, progress: Callable[[str], None] | None = None,
              probe_tokens: tuple[int, ...] | None = None,
              probe_dir: str | None = None,
              on_result: Callable[[CellResult], None] | None = None,
              store_probe_dir: str | None = None) -> list[CellResult]:
    """Group cells by model, build each model once, probe it, measure its cells. With
    `probe_dir` every probe's measured points are kept there as JSON (and a probe found there
    is used), so `reprice` can re-price both columns after a change to the model without
    running anything. `store_probe_dir`: every probe is measured and written there, never
    read: a TP rank's own folder, since the ranks of a TP group must all probe (their layers
    run collectives together) and each rank's probe prices that rank."""
    cells = list(cells)
    geometries = calibration_geometries()
    groups: dict[tuple[str, str, int, str, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.geometry, c.built_policy, c.lora_rank, c.dtype, c.build),
                          []).append(c)
    results: list[CellResult] = []
    for (geo, policy, rank, dtype, build), group in groups.items():
        model = CalibrationModel(geometries[geo], POLICY_BY_NAME[policy], lora_rank=rank,
                                 tensor_parallel=tensor_parallel, dtype=dtype, cells=group,
                                 probe_tokens=probe_tokens, probe_dir=probe_dir,
                                 implementation=implementation_for(build),
                                 context_parallel=context_parallel,
                                 expert_parallel=expert_parallel)
        if store_probe_dir is not None:
            store_probe(model.coefficients, store_probe_dir)
        for cell in group:
            result = model.measure(cell)
            results.append(result)
            if on_result:
                on_result(result)
            if progress:
                progress(f"{geo} {cell.policy} r{rank} {cell.lengths} {cell.outputs} "
                         f"{'grad' if cell.grad else 'nograd'}: measured "
                         f"{result.measured_bytes / 2**20:.2f} MiB, ratio {result.ratio:.4f} "
                         f"(defaults {result.default_ratio:.3f})")
        del model
    return results


def merge_rank_rows(per_rank: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per cell from every TP rank's rows of the same cells: the busiest rank's
    measurement, priced by the highest estimate any rank's memory model gives (each rank
    prices itself with its own probe; `reprice_rows` re-prices TP rows the same way)."""
    merged = []
    for rows in zip(*per_rank, strict=True):
        busiest = max(rows, key=lambda r: r["measured_bytes"])
        predicted = max(r["predicted_bytes"] for r in rows)
        default = max(r["predicted_default_bytes"] for r in rows)
        own = ({} if "own_routing_bytes" not in busiest else {
            "own_routing_bytes": (b := max(r["own_routing_bytes"] for r in rows)),
            "own_routing_ratio": round(b / busiest["measured_bytes"], 4),
            "own_routing_default_bytes": (d := max(r["own_routing_default_bytes"]
                                                   for r in rows)),
            "own_routing_default_ratio": round(d / busiest["measured_bytes"], 4)})
        merged.append(dict(busiest) | {
            "predicted_bytes": predicted, "predicted_default_bytes": default,
            "ratio": round(predicted / busiest["measured_bytes"], 4),
            "default_ratio": round(default / busiest["measured_bytes"], 4)} | own)
    return merged


def implementation_for(build: str) -> Implementation | None:
    """A cell's build: None (what this machine builds: on CPU the local spec with the segmented
    flash attention) for "local", Megatron's unfused attention on the local spec for
    "local-unfused", the CPU stand-ins of the fused kernels for "gpu-shaped"."""
    if build == "local":
        return None
    if build == "local-unfused":
        return Implementation.cpu_local("unfused")
    if build == "gpu-shaped":
        return Implementation.cpu_gpu_shaped()
    raise ValueError("calibration build must be 'local', 'local-unfused' or 'gpu-shaped', "
                     f"got {build!r}")


def default_memory_model(cell: Cell, implementation: Implementation | None = None
                         ) -> MemoryModel:
    """The what-if memory model for a cell, built from the geometry alone (no model, no
    probe): what the CLI and a laptop see."""
    from art.megatron.recompute import resolve_recompute
    from art.trainer_rank._request import LoraShape

    geometry = calibration_geometries()[cell.geometry]
    impl = implementation or implementation_for(cell.build) or Implementation.cpu_local()
    policy = POLICY_BY_NAME[cell.built_policy]

    def resolve(granularity: Any, method: Any, num_layers: Any, modules: Any) -> Any:
        return resolve_recompute(
            granularity=granularity, method=method, num_layers=num_layers, modules=modules,
            moe_layers=geometry.moe_layers, layer_types=geometry.layer_types,
            norm_fused_into_linear=impl.norm_fused_into_linear)

    recompute = resolve(policy.granularity, policy.method, policy.num_layers, policy.modules)
    if cell.built_with:
        from art.megatron.recompute_ladder import build_ladder

        recompute = rung_by_name(build_ladder(recompute, resolve), cell.policy)
    layout = ParallelLayout(tensor_parallel=cell.tensor_parallel,
                            context_parallel=cell.context_parallel,
                            expert_parallel=cell.expert_parallel,
                            # As calibration_provider builds it (Megatron's default: TP).
                            expert_tensor_parallel=(1 if cell.expert_parallel > 1
                                                    else cell.tensor_parallel),
                            data_parallel=cell_world_size(cell) // (cell.tensor_parallel
                                                                * cell.context_parallel),
                            sequence_parallel=calibration_sequence_parallel(
                                geometry, cell.tensor_parallel))
    return MemoryModel(geometry, layout=layout,
                       recompute=recompute, implementation=impl,
                       lora=LoraShape(cell.lora_rank, lora_targets_for(geometry)),
                       dtype=cell.dtype)
