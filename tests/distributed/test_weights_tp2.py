"""HF checkpoints at TP=2 (with and without sequence parallel) and MoE at expert-TP 2 and 1,
under torchrun with real ranks, all layouts in one launch: logprobs equal transformers',
export bit-identical, the planner's resident weight term equals the live weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _hf_models import hf_logprobs, save_hf_model, token_sequences

from _torchrun import run_torchrun

WORKER = Path(__file__).with_name("weights_worker.py")
TOLERANCE = 1e-4


@pytest.mark.torchrun
def test_tp2_and_expert_tp_load_with_parity_and_export(tmp_path):
    qwen3 = save_hf_model("qwen3", tmp_path / "qwen3")
    llama = save_hf_model("llama", tmp_path / "llama", tied=True)
    moe = save_hf_model("qwen3_moe", tmp_path / "moe")
    for folder in (qwen3, llama, moe):
        sequences = token_sequences(256)
        logprobs = hf_logprobs(folder, sequences)
        torch.save({"sequences": sequences, "logprobs": logprobs},
                   folder / "reference.pt")
    tp2 = {"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "2"}
    cases = [
        {"name": "qwen3 TP2 SP", "folder": str(qwen3), "reference": str(qwen3 / "reference.pt"),
         "env": tp2},
        {"name": "llama tied TP2", "folder": str(llama), "reference": str(llama / "reference.pt"),
         "env": {**tp2, "ART_MEGATRON_SEQUENCE_PARALLEL": "0"}},
        {"name": "qwen3_moe TP2 ETP2", "folder": str(moe), "reference": str(moe / "reference.pt"),
         "env": tp2},
        {"name": "qwen3_moe TP2 ETP1", "folder": str(moe), "reference": str(moe / "reference.pt"),
         "env": {**tp2, "ART_MEGATRON_EXPERT_TENSOR_PARALLEL_SIZE": "1"}},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_torchrun(WORKER, str(tmp_path / "cases.json"), str(tmp_path), nproc=2, timeout_s=240)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, row in enumerate(rows):
        assert set(row) == {c["name"] for c in cases}
        for name, result in row.items():
            label = f"rank {rank} {name}: {result}"
            assert result["logprob_max_abs_diff"] < TOLERANCE, label
            assert result["priced_weight_bytes"] == result["live_param_bytes"], label
    assert rows[0]["qwen3_moe TP2 ETP1"]["expert_tp"] == 1
    assert rows[0]["qwen3_moe TP2 ETP2"]["expert_tp"] == 2
    for name, result in rows[0].items():
        assert result["export_same_names"] and result["export_differs"] == [], name
