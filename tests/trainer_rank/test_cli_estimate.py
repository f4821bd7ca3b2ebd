"""`python -m art.trainer_rank estimate`: flags, ART_MEGATRON_* fallback, JSON, the seed case."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from art.trainer_rank.cli.args import parse_size_bytes
from art.trainer_rank.cli.main import main

GIB = 2**30
SEED = ["--model", "Qwen3.5-27B", "--sequences", "16355,16355", "--outputs", "hidden_states",
        "--lora-rank", "1", "--sp", "--attention", "flash"]


def _json(capsys, argv: list[str]) -> dict:
    status = main(["estimate", *argv, "--json"])
    data = json.loads(capsys.readouterr().out)
    # 3 when --gpu-memory is given and the peak does not fit, as `plan` answers; else 0.
    assert status == (3 if data.get("fits") is False else 0), (status, data.get("fits"))
    return data


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("ART_MEGATRON_") or name == "PYTORCH_CUDA_ALLOC_CONF":
            monkeypatch.delenv(name, raising=False)


def test_seed_case_through_the_cli(capsys):
    full2 = _json(capsys, [*SEED, "--tp", "2", "--recompute", "full", "--gpu-memory",
                           "107.192GB"])
    assert {"peak_bytes", "dynamic_bytes", "resident_bytes", "terms", "recompute", "fits"} \
        <= set(full2)
    assert full2["fits"] is True and "full recompute" in full2["recompute"]
    allocated = full2["resident_bytes"] + max(full2["forward_peak_bytes"],
                                              full2["backward_peak_bytes"])
    assert 0.9 * 41 <= allocated / GIB <= 1.1 * 41
    sel2 = _json(capsys, [*SEED, "--tp", "2", "--recompute", "selective", "--gpu-memory",
                          "107.192GB"])
    assert sel2["fits"] is False and sel2["peak_bytes"] > 107.192e9
    sel4 = _json(capsys, [*SEED, "--tp", "4", "--recompute", "selective", "--gpu-memory",
                          "119.289GB"])
    assert sel4["fits"] is False and sel4["peak_bytes"] > 119.289e9
    assert sel2["terms"]["weights"] > sel4["terms"]["weights"]


def test_unset_flags_fall_back_to_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE", "4")
    monkeypatch.setenv("ART_MEGATRON_RECOMPUTE_GRANULARITY", "selective")
    monkeypatch.setenv("ART_MEGATRON_RECOMPUTE_METHOD", "none")
    monkeypatch.setenv("ART_MEGATRON_RECOMPUTE_NUM_LAYERS", "none")
    from_env = _json(capsys, ["--model", "Qwen3-8B", "--tokens", "8192"])
    assert from_env["layout"].startswith("TP4") and "SP" in from_env["layout"]
    assert "selective recompute (core_attn)" == from_env["recompute"]
    flags = _json(capsys, ["--model", "Qwen3-8B", "--tokens", "8192", "--tp", "1",
                           "--recompute", "full"])
    assert flags["layout"] == "TP1" and flags["recompute"].startswith("full recompute")


def test_outputs_grad_and_modules_change_the_estimate(capsys):
    base = ["--model", "Qwen3-8B", "--tokens", "8192", "--recompute", "selective"]
    logprobs = _json(capsys, [*base, "--outputs", "logprobs"])
    logits = _json(capsys, [*base, "--outputs", "logprobs,logits"])
    assert logits["dynamic_bytes"] > logprobs["dynamic_bytes"] + 8192 * 151936 * 4 * 0.9
    nograd = _json(capsys, [*base, "--no-grad"])
    assert nograd["dynamic_bytes"] < logprobs["dynamic_bytes"]
    with_mlp = _json(capsys, [*base, "--recompute-modules", "core_attn,mlp"])
    assert with_mlp["dynamic_bytes"] < logprobs["dynamic_bytes"]
    assert with_mlp["recompute"] == "selective recompute (core_attn+mlp)"
    unfused = _json(capsys, [*base, "--attention", "unfused"])
    assert "packed attention mask" in unfused["terms"]


def test_bad_input_says_what_was_wrong(capsys):
    assert main(["estimate", "--model", "no-such-model", "--tokens", "10"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["estimate", "--model", "Qwen3-8B", "--tokens", "10", "--recompute", "full",
                 "--recompute-num-layers", "5"]) == 2
    assert "divide" in capsys.readouterr().err
    assert parse_size_bytes("107.192GB") == 107_192_000_000
    assert parse_size_bytes("2") == 2 * GIB


def test_module_entry_point_prints_the_table():
    proc = subprocess.run(
        [sys.executable, "-m", "art.trainer_rank", "estimate", *SEED, "--tp", "2",
         "--recompute", "full"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PEAK per rank" in proc.stdout and "full recompute" in proc.stdout


def test_the_rungs_and_what_each_setting_runs(capsys):
    """The seed's group at TP=2 under selective recompute: every rung priced least work
    first, and escalate runs the least-work rung above selective that fits 107.192 GB."""
    data = _json(capsys, [*SEED, "--tp", "2", "--recompute", "selective", "--gpu-memory",
                          "107.192GB"])
    table = data["recompute_rungs"]
    rungs = table["rungs"]
    work = [r["recomputed_gflops"] for r in rungs]
    assert work == sorted(work) and work[0] == 0 and rungs[-1]["name"] == "full uniform 1"
    (configured,) = [r for r in rungs if r["configured"]]
    assert configured["name"] == "selective core_attn" and configured["fits"] is False
    picks = table["picks"]
    assert picks["configured"] is None
    above = [r for r in rungs if r["recomputed_gflops"] > configured["recomputed_gflops"]]
    first_fit = next(r for r in above if r["fits"])
    assert picks["escalate"] == first_fit["name"] and first_fit["name"].startswith("full block")
    assert all(r["peak_bytes"] > 107_192_000_000 for r in above[:above.index(first_fit)])
    assert picks["adaptive"] == next(r["name"] for r in rungs if r["fits"])
    no_grad = _json(capsys, [*SEED, "--tp", "2", "--recompute", "selective", "--no-grad"])
    assert no_grad["recompute_rungs"] is None


def test_expert_load_prices_the_router_spread_it_names(capsys):
    """`--expert-load` prices a MoE model's experts under EP at the router's spread it gives
    (working, held, expert shares of the even share) instead of the even share: the
    backward peak grows, one value stands for all three, and the layers' note names the
    shares as assumed. What is no spread (under 1, held over working, not three values) or
    cannot apply (EP=1, a dense model, beside --worst-case-routing) is refused."""
    moe = ["--model", "Qwen3-30B-A3B", "--tokens", "8192", "--ep", "2"]
    even = _json(capsys, moe)
    spread = _json(capsys, [*moe, "--expert-load", "1.25,1.1,1.8"])
    assert spread["backward_peak_bytes"] > even["backward_peak_bytes"] * 1.02
    notes = " ".join(t["note"] for t in spread["term_details"])
    assert "routing at 1.250 of the even share in a layer, 1.100 over the layers" in notes
    assert "its busiest expert at 1.800 (assumed)" in notes
    assert "balanced routing over EP2" in " ".join(t["note"] for t in even["term_details"])
    assert even["expert_load"] is None
    assert spread["expert_load"] == {"working": 1.25, "held": 1.1, "expert": 1.8}
    one = _json(capsys, [*moe, "--expert-load", "1.2"])
    three = _json(capsys, [*moe, "--expert-load", "1.2,1.2,1.2"])
    assert one["peak_bytes"] == three["peak_bytes"] > even["peak_bytes"]
    for bad, words in [(["--expert-load", "0.9"], "at least 1.0"),
                       (["--expert-load", "1.1,1.2"], "one share or three"),
                       (["--expert-load", "1.1,1.2,1.5"], "cannot exceed its working share"),
                       (["--expert-load", "nan"], "one share or three")]:
        with pytest.raises(SystemExit) as exited:
            main(["estimate", *moe, *bad])
        assert exited.value.code == 2
        assert words in capsys.readouterr().err, bad
    for argv, words in [
            (["--model", "Qwen3-30B-A3B", "--tokens", "64", "--expert-load", "1.2"], "EP=1"),
            (["--model", "Qwen3-8B", "--tokens", "64", "--expert-load", "1.2"],
             "no routed experts"),
            ([*moe, "--expert-load", "1.2", "--worst-case-routing"], "give one")]:
        assert main(["estimate", *argv]) == 2
        assert words in capsys.readouterr().err, argv
