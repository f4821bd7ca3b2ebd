"""Benchmark: memory a rank uses while loading a Hugging Face checkpoint, against its shard.

Makes a random Qwen3-shaped checkpoint with transformers (fp32, about 250 MB), then loads it
under torchrun at TP=1 and TP=2. Each rank builds its model first (the shard exists before the
load starts) and then measures, during `load_into` only:
- meter peak: the peak of tensor storages created inside the load as the project's meter
  (MemoryMeter) counts them. It counts safetensors' slices at the size of the whole
  tensor they view, although that storage is the memory-mapped file, not allocated memory;
  so it is the largest single tensor, not a private allocation;
- anonymous RSS: the peak rise of the process's RssAnon (sampled every 0.2 ms by a thread),
  which also catches allocations outside torch (safetensors, Python);
- file-backed RSS: the rise of RssFile, the checkpoint pages the rank touched through its
  memory maps (page cache, reclaimable, shared between ranks on one node).
Figures go to bench/weights_load.json and bench/WEIGHTS_LOAD.md.

    .venv/bin/python scripts/bench_weights_load.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
SHAPE = dict(num_hidden_layers=6, hidden_size=768, intermediate_size=2048,
             num_attention_heads=12, num_key_value_heads=4, head_dim=64, vocab_size=16384)


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+)", text, re.M).group(1))


class _RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base_anon = _status_kib("RssAnon")
        self.base_file = _status_kib("RssFile")
        self.peak_anon = self.base_anon
        self.peak_file = self.base_file
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self._sample()
            time.sleep(0.0002)

    def _sample(self) -> None:
        self.peak_anon = max(self.peak_anon, _status_kib("RssAnon"))
        self.peak_file = max(self.peak_file, _status_kib("RssFile"))

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self._sample()


def worker(folder: Path, out: Path) -> None:
    import gc

    import torch

    from art.megatron.provider import Provider
    from art.megatron.settings import load_settings
    from art.megatron.weights import load_into, prepare_checkpoint
    from art.trainer_rank.measuring.meter import MemoryMeter

    tp = os.environ.get("WORLD_SIZE", "1")
    settings = load_settings({"ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": tp,
                              "ART_MEGATRON_RECOMPUTE_GRANULARITY": "none"})
    provider = Provider(folder, settings=settings, dtype="float32")
    provider.initialize_distributed()
    prepared = prepare_checkpoint(folder, provider.geometry)
    model = provider.build_model(seed=0)
    gc.collect()
    sampler = _RssSampler()
    sampler.start()
    started = time.perf_counter()
    with MemoryMeter(device="cpu") as meter:
        report = load_into(model, prepared)
    seconds = time.perf_counter() - started
    sampler.stop()
    rank = torch.distributed.get_rank()
    row = {
        "tp": int(tp), "rank": rank, "parameters": report.parameters,
        "shard_bytes": report.shard_bytes,
        "checkpoint_bytes": prepared.checkpoint.total_bytes,
        "torch_peak_bytes": meter.peak_bytes,
        "anon_rss_rise_bytes": (sampler.peak_anon - sampler.base_anon) * 1024,
        "file_rss_rise_bytes": (sampler.peak_file - sampler.base_file) * 1024,
        "load_seconds": round(seconds, 3),
    }
    (out / f"tp{tp}_rank{rank}.json").write_text(json.dumps(row))
    from art.megatron.distributed import shutdown_distributed

    shutdown_distributed()


def _make_checkpoint(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**SHAPE, max_position_embeddings=4096, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def _markdown(rows: list[dict]) -> str:
    lines = [
        "# Loading a Hugging Face checkpoint: memory per rank",
        "",
        f"Written by `scripts/bench_weights_load.py` (random Qwen3-shaped checkpoint, fp32, "
        f"{rows[0]['checkpoint_bytes'] / MIB:.1f} MiB: {SHAPE['num_hidden_layers']} layers, "
        f"hidden {SHAPE['hidden_size']}, vocab {SHAPE['vocab_size']}; CPU, gloo). Each rank's "
        "model is built before the load; figures cover `load_into` only.",
        "",
        "| TP | rank | shard (MiB) | meter peak, file views (MiB) | anon RSS rise (MiB) "
        "| anon rise / shard | file-backed RSS rise (MiB) | seconds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tp']} | {r['rank']} | {r['shard_bytes'] / MIB:.1f} | "
            f"{r['torch_peak_bytes'] / MIB:.2f} | {r['anon_rss_rise_bytes'] / MIB:.1f} | "
            f"{r['anon_rss_rise_bytes'] / r['shard_bytes']:.3f} | "
            f"{r['file_rss_rise_bytes'] / MIB:.1f} | {r['load_seconds']} |"
        )
    lines += [
        "",
        "The loader copies memory-mapped file views into the parameters in place. meter peak: "
        "storages the project's meter saw created during the load; safetensors' slices are "
        "views of the mapped file and are counted at the size of the whole tensor they view "
        "(the largest tensor of the file), though nothing is allocated for them. anon RSS "
        "rise: the process's private memory above what it held when the load began (sampled "
        "every 0.2 ms): what the load really allocates. file-backed RSS rise: checkpoint pages "
        "the rank mapped (page cache, shared by the ranks of a node, reclaimable); a column "
        "split (row-parallel linears) touches every page of the tensor although only the "
        "rank's columns are copied, so TP=2 maps more than half the file.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=str(ROOT / "bench"))
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), Path(args.worker[1]))
        return 0
    sys.path.insert(0, str(ROOT))
    from art.megatron.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "checkpoint", Path(tmp) / "rows"
        out.mkdir()
        _make_checkpoint(folder)
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        for nproc in (1, 2):
            subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                 f"--master_port={free_port()}", "--master_addr=127.0.0.1", __file__,
                 "--worker", str(folder), str(out)],
                check=True, env=env, cwd=ROOT,
            )
        rows = sorted((json.loads(p.read_text()) for p in out.glob("*.json")),
                      key=lambda r: (r["tp"], r["rank"]))
    bench = Path(args.out_dir)
    bench.mkdir(parents=True, exist_ok=True)
    (bench / "weights_load.json").write_text(json.dumps(rows, indent=1) + "\n")
    (bench / "WEIGHTS_LOAD.md").write_text(_markdown(rows))
    print(_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
