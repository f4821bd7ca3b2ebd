"""The phase protocol's pieces that need no second rank: the fault record survives the store
round trip and builds one error text, OOM locations are read from the traceback, collective
failures are told apart from other errors. Multi-rank behaviour: tests/distributed/
test_phase_faults_tp2.py."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from art.trainer_rank import TrainerRankMemoryError, TrainerRankPeerError
from art.trainer_rank.ranks.faults import (
    ERROR,
    FORWARD,
    HEADS,
    OPTIMIZER_STEP,
    Fault,
    FaultKind,
    MicroBatchContext,
    Phase,
    is_communication_error,
    where_in_model,
)
from art.trainer_rank.ranks.phases import PhaseAgreement

CONTEXT = MicroBatchContext(call=2, micro_batch=3, items=(4, 7), signature="sig",
                            packed_tokens=640, usable_bytes=2**30, predicted_bytes=2**29,
                            recompute_summary="selective recompute (core_attn)")


def test_fault_round_trip_gives_one_error_on_every_rank():
    fault = Fault(rank=1, phase=HEADS, where="", detail="OutOfMemoryError: x", context=CONTEXT)
    again = Fault.from_json(fault.to_json())
    assert again == fault
    a, b = fault.error(), again.error()
    assert isinstance(a, TrainerRankMemoryError) and str(a) == str(b)
    assert "rank 1 ran out of memory in the heads of micro-batch 3" in str(a)
    assert a.indices_not_run == (4, 7) and a.usable_limit_bytes == 2**30


def _raise_in(filename: str, layer_number: int) -> BaseException:
    # A frame whose code lives in a file named like Megatron's layer module, as in a real OOM.
    source = (f"class Layer:\n    layer_number = {layer_number}\n    def forward(self):\n"
              "        raise torch.OutOfMemoryError('x')\n")
    scope: dict = {"torch": torch}
    exec(compile(source, filename, "exec"), scope)
    try:
        scope["Layer"]().forward()
    except torch.OutOfMemoryError as exc:
        return exc
    raise AssertionError("no error")


def test_oom_location_comes_from_the_traceback():
    exc = _raise_in("/x/megatron/core/transformer/transformer_layer.py", 3)
    assert where_in_model(exc) == ("forward", "layer 3")
    assert where_in_model(_raise_in("/x/art/trainer_rank/compute/heads.py", 1)) == (HEADS, "")


def test_collective_failures_are_told_apart():
    assert is_communication_error(RuntimeError(
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert is_communication_error(dist.DistBackendError("NCCL error"))
    assert not is_communication_error(RuntimeError("shape mismatch"))
    assert not is_communication_error(ValueError("Connection closed by peer"))


def test_single_process_agreement_is_local():
    agreement = PhaseAgreement(fault_timeout_s=1.0)
    agreement.check()  # nothing published
    with pytest.raises(RuntimeError, match="shape"):
        with agreement.compute(CONTEXT, replica_size=1):
            raise RuntimeError("shape mismatch")
    with pytest.raises(torch.OutOfMemoryError):  # one-rank replica: recovered by the caller
        with agreement.compute(CONTEXT, replica_size=1):
            raise torch.OutOfMemoryError("x")


def test_an_error_fault_gives_the_other_ranks_a_peer_error_naming_it():
    fault = Fault(rank=1, phase=FORWARD, where="layer 2", detail="ValueError: bad shape",
                  context=CONTEXT, kind=ERROR, error_type="ValueError")
    again = Fault.from_json(fault.to_json())
    assert again == fault
    error = again.error()
    assert isinstance(error, TrainerRankPeerError)
    assert (error.failing_rank, error.phase, error.error_type, error.error_message) == (
        1, FORWARD, "ValueError", "bad shape")
    assert "rank 1 raised ValueError: bad shape in the forward of micro-batch 3" in str(error)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_the_fault_record_crosses_ranks_as_words_and_comes_back_as_members():
    fault = Fault(rank=0, phase=Phase.CALLER_BACKWARD, where="", detail="OutOfMemoryError: x",
                  context=None, kind=FaultKind.OOM)
    assert fault.to_json() == (
        '{"rank": 0, "phase": "caller backward", "where": "", "detail": "OutOfMemoryError: x", '
        '"context": null, "kind": "oom", "error_type": ""}')
    again = Fault.from_json(fault.to_json())
    assert again.phase is Phase.CALLER_BACKWARD and again.kind is FaultKind.OOM


def test_an_optimizer_step_fault_has_no_micro_batch():
    fault = Fault(rank=0, phase=OPTIMIZER_STEP, where="step 4", detail="OutOfMemoryError: x",
                  context=None)
    error = Fault.from_json(fault.to_json()).error()
    assert isinstance(error, TrainerRankMemoryError)
    assert "rank 0 ran out of memory in the optimizer step (step 4)" in str(error)


def test_single_process_vote_and_step_are_local():
    agreement = PhaseAgreement(fault_timeout_s=1.0)
    assert agreement.vote(False, 1) is None and agreement.vote(True, 1) == 0
    with pytest.raises(ValueError, match="x"):
        with agreement.optimizer_step(1):
            raise ValueError("x")
    assert agreement.fault is None  # nothing to publish with no peer


def test_groups_close_inside_a_meter_whose_limit_an_oom_reached():
    # A rank closes its process groups right after an OOM, often inside the trainer's meter
    # with its live bytes at the limit: closing must allocate nothing there (an OOM raised
    # while closing left the groups open and the peers blocked on them: the TP=2 x DP=2
    # soak's hang after an OOM in the caller's backward). One real gloo process group.
    from art.trainer_rank.measuring.meter import MemoryMeter
    from art.trainer_rank.ranks.phases import close_process_groups

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        live = torch.ones(64)
        with MemoryMeter(limit_bytes=1 << 20) as meter:
            kept = live * 2
            meter.limit_bytes = meter._live_bytes  # the next allocation would cross it
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(1)
            close_process_groups()
        assert kept.shape == live.shape
    finally:
        if started:
            dist.destroy_process_group()


def test_the_backward_guard_is_installed_only_while_a_caller_phase_is_open():
    original = torch.autograd.backward
    agreement = PhaseAgreement(fault_timeout_s=1.0)
    x = torch.ones(2, requires_grad=True)
    with agreement.caller_phase(CONTEXT, replica_size=1):
        assert torch.autograd.backward is not original
        with agreement.caller_phase(CONTEXT, replica_size=1):  # nested: still the guard
            guard = torch.autograd.backward
            (x * 2).sum().backward()  # one-rank replica: runs through the guard unchanged
        assert torch.autograd.backward is guard
    assert torch.autograd.backward is original and torch.equal(x.grad, torch.full((2,), 2.0))
    # A caller phase left by an exception restores it too.
    with pytest.raises(ValueError):
        with agreement.caller_phase(CONTEXT, replica_size=1):
            raise ValueError("the caller's loop body failed")
    assert torch.autograd.backward is original
