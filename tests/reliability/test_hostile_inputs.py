"""Hostile input, everywhere a user can give it: the environment (ART_TRAINER_RANK_*,
ART_MEGATRON_*, the profile file), a model folder (config.json, safetensors), the items
handed to forward_micro_batches / dp_rank_forward, the command line (estimate, plan) and the
demo's flags. One table; every row asserts the error type (for the commands: the exit
status), that the one-line message names the input and the value, and that state and files
are unchanged afterwards (every file under the test's folders, the environment, and the
trainer: profiles, stats, parameters, gradients, slots). Rows marked `before_build` must
fail before any Megatron model is built.

Most rows are pure validation; the item rows share one tiny trainer (probing on, as a user's
is), the model-folder rows enter through build_training_runtime like a driver does.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _reliability import write_counts

from art.megatron import model_builder
from art.megatron.implementation import Implementation
from art.megatron.provider import Provider
from art.trainer_rank import (
    ForwardInput,
    TrainerRank,
    TrainerRankOptions,
    TrainerRankSlotStateError,
)
from art.trainer_rank._request import OutputRequest
from art.trainer_rank.decide.profiles import ProfileStore
from art.trainer_rank.measuring.virtual_limit import ENV_TEST_MEMORY_LIMIT

from _tiny import tiny_dense
from _upstream_env import environment

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256  # the items' trainer and the checkpoints
ENV = "ART_TRAINER_RANK_"
MEG = "ART_MEGATRON_"


class Refused(Exception):
    """A command that refused: its exit status and what it printed (stderr, else the last
    line of stdout)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


@dataclass(frozen=True)
class Case:
    category: str  # env | model folder | items | CLI | demo
    name: str
    run: Callable[[Any], object]
    error: type[BaseException]  # a warning class for warns=True rows
    mentions: tuple[str, ...]  # every one is in the message: the input and its value
    status: int | None = None  # commands: the exit status
    before_build: bool = True
    warns: bool = False


# ---------------------------------------------------------------- the world the rows act on


class World:
    """The folders and objects rows refer to; built once, compared before and after each row."""

    def __init__(self, root: Path, checkpoint: Path) -> None:
        self.root = root
        self.checkpoint = checkpoint
        self.dir = root / "a-directory"
        self.dir.mkdir()
        self.file = root / "a-file.txt"
        self.file.write_text("not a directory\n")
        self.other_version = root / "profiles-v999.json"
        self.other_version.write_text(json.dumps({"version": 999, "profiles": {}}))
        self.corrupt = root / "profiles-corrupt.json"
        self.corrupt.write_text('{"version": 2, "profi')
        self.folders: dict[str, Path] = {}
        self._trainer: TrainerRank | None = None

    def folder(self, name: str) -> Path:
        return self.folders[name]

    @property
    def trainer(self) -> TrainerRank:
        if self._trainer is None:
            from art.megatron.settings import load_settings
            from art.megatron.train import TrainingRuntime

            provider = Provider(tiny_dense(num_layers=2, hidden=32, vocab=VOCAB),
                                settings=load_settings({MEG + "RECOMPUTE_GRANULARITY":
                                                        "selective"}),
                                dtype="float32", implementation=Implementation.cpu_local())
            model = provider.build_model(seed=0)
            self._trainer = TrainerRank(TrainingRuntime.for_model(
                model, provider, trainer_options=TrainerRankOptions(
                    test_memory_limit_bytes=64 * 2**20)))
        return self._trainer

    def state(self) -> dict[str, Any]:
        files = {}
        for path in sorted(self.root.rglob("*")):
            key = str(path.relative_to(self.root))
            files[key] = (hashlib.sha1(path.read_bytes()).hexdigest() if path.is_file()
                          else "dir")
        # Megatron sets its NVTE_* attention switches when it first builds a model in a process.
        environ = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
        state: dict[str, Any] = {"files": files, "environ": environ,
                                 "cwd": sorted(p.name for p in Path.cwd().iterdir())}
        trainer = self._trainer
        if trainer is not None:
            state["trainer"] = {
                "profiles": {s: (p.observations, p.misses)
                             for s, p in trainer.profiles.profiles.items()},
                "stats": len(trainer.stats_history), "calls": trainer._calls,
                "slots": sorted(trainer.slots.slots), "active": trainer.active_checkpoint,
                "parameters": {n: hashlib.sha1(p.detach().numpy().tobytes()).hexdigest()
                               for n, p in trainer.model.named_parameters()},
                "grads": {n: None if p.grad is None else float(p.grad.abs().sum())
                          for n, p in trainer.model.named_parameters()},
            }
        return state


def cli(*argv: str, env: dict[str, str] | None = None) -> None:
    """`python -m art.trainer_rank ARGV` in this process; Refused unless it exits 0."""
    from art.trainer_rank.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with environment(env or {}), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            status = main(list(argv))
        except SystemExit as exit_:  # argparse's usage errors
            status = int(exit_.code or 0)
    if status:
        text = err.getvalue().strip() or out.getvalue().strip().splitlines()[-1]
        raise Refused(status, text)


def demo(*argv: str, env: dict[str, str] | None = None) -> None:
    """./scripts/demo ARGV up to the point where it would exec torchrun; Refused unless it
    would launch (which, in this table, fails the row)."""
    import demo_launch

    err = io.StringIO()

    def no_launch(*_args: Any) -> None:
        raise AssertionError(f"the demo would launch torchrun with {argv}")

    with environment(env or {}), contextlib.redirect_stderr(err), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo_launch.os, "execv", no_launch)
        try:
            status = demo_launch.main(list(argv))
        except SystemExit as exit_:
            status = int(exit_.code or 0)
    raise Refused(status, err.getvalue().strip())


# ---------------------------------------------------------------- the environment

def options(**env: str) -> Callable[[World], object]:
    """TrainerRankOptions from ART_TRAINER_RANK_<name>=value; "{dir}", "{file}" in a value
    name the world's directory and file."""
    def run(world: World) -> object:
        values = {ENV + k: v.format(dir=world.dir, file=world.file) for k, v in env.items()}
        return TrainerRankOptions.from_env(values)
    return run


def megatron(implementation: Implementation | None = None,
             **env: str) -> Callable[[World], object]:
    """A provider from ART_MEGATRON_<name>=value, built with `implementation` (by default
    the CPU local spec with its default attention)."""
    def run(world: World) -> object:
        return Provider.from_env(tiny_dense(), env={MEG + k: v for k, v in env.items()},
                                 dtype="float32",
                                 implementation=implementation or Implementation.cpu_local())
    return run


def _env_cases() -> list[Case]:
    rows: list[tuple[str, dict[str, str], tuple[str, ...]]] = [
        ("profile path is a directory", {"PROFILE_PATH": "{dir}"}, ("is a directory",)),
        ("profile path under a file", {"PROFILE_PATH": "{file}/profiles.json"},
         ("is a file, not a directory",)),
        ("profile path in /proc", {"PROFILE_PATH": "/proc/art-profiles/p.json"},
         ("cannot be written",)),
        ("profile path is /dev/null", {"PROFILE_PATH": "/dev/null"}, ("not a regular file",)),
        ("probe cache dir is a file", {"PROBE_CACHE_DIR": "{file}"},
         ("is a file, not a directory",)),
        ("probe cache dir under a file", {"PROBE_CACHE_DIR": "{file}/probes"},
         ("which is a file",)),
        ("probe cache dir in /proc", {"PROBE_CACHE_DIR": "/proc/art-probes"},
         ("cannot be written",)),
        *[(f"cold start fraction {v}", {"COLD_START_FRACTION": v}, ())
          for v in ("0", "1.5", "-0.1", "abc", "nan")],
        *[(f"trust window {v}", {"TRUST_WINDOW": v}, ()) for v in ("0.5", "inf", "abc")],
        *[(f"head chunk tokens {v}", {"HEAD_CHUNK_TOKENS": v}, ())
          for v in ("0", "-4", "1.5", "abc")],
        *[(f"fault timeout {v}", {"FAULT_TIMEOUT_S": v}, ())
          for v in ("0", "-1", "inf", "nan")],
        *[(f"test memory limit {v}", {"TEST_MEMORY_LIMIT_BYTES": v}, ())
          for v in ("-5", "0", "abc", "1e999")],
        ("escalate is not a boolean", {"ESCALATE_TO_FULL_RECOMPUTE": "maybe"}, ()),
        ("probe layers is not a boolean", {"PROBE_LAYERS": "2"}, ()),
    ]
    cases = []
    for name, env, extra in rows:
        (variable, value), = env.items()
        shown = "" if "{" in value else value  # a path placeholder: the variable is enough
        cases.append(Case("env", name, options(**env), ValueError,
                          (ENV + variable, shown, *extra)))
    cases += [
        Case("env", "unknown variable", options(PROFILE_PATHS="x"), ValueError,
             (ENV + "PROFILE_PATHS", "did you mean " + ENV + "PROFILE_PATH")),
        Case("env", "options argument: profile path is a directory",
             lambda w: TrainerRankOptions(profile_path=str(w.dir)), ValueError,
             ("TrainerRankOptions.profile_path", "is a directory")),
        Case("env", "options argument: cold start fraction 2",
             lambda w: TrainerRankOptions(cold_start_fraction=2.0), ValueError,
             ("TrainerRankOptions.cold_start_fraction=2.0",)),
        Case("env", "profile file of another version",
             lambda w: ProfileStore(w.other_version), RuntimeWarning,
             ("profiles-v999.json", "version 999", "renamed aside"), warns=True),
        Case("env", "profile file that does not parse",
             lambda w: ProfileStore(w.corrupt), RuntimeWarning,
             ("profiles-corrupt.json", "not JSON", "renamed aside"), warns=True),
    ]
    for name, env, mentions in [
        ("TP 0", {"TENSOR_MODEL_PARALLEL_SIZE": "0"}, ("TENSOR_MODEL_PARALLEL_SIZE='0'",)),
        ("TP abc", {"TENSOR_MODEL_PARALLEL_SIZE": "abc"}, ("'abc'",)),
        ("TP 3 on 8 heads", {"TENSOR_MODEL_PARALLEL_SIZE": "3"},
         ("TENSOR_MODEL_PARALLEL_SIZE=3", "num_attention_heads=8")),
        ("granularity partial", {"RECOMPUTE_GRANULARITY": "partial"}, ("'partial'",)),
        ("misspelt granularity", {"RECOMPUTE_GRANULARTY": "full"},
         (MEG + "RECOMPUTE_GRANULARTY", "did you mean")),
        ("sequence parallel maybe", {"SEQUENCE_PARALLEL": "maybe"}, ("'maybe'",)),
        ("selective with a layer count", {"RECOMPUTE_GRANULARITY": "selective",
                                          "RECOMPUTE_NUM_LAYERS": "2"},
         (MEG + "RECOMPUTE_NUM_LAYERS=2", "selective")),
        ("unknown recompute module", {"RECOMPUTE_GRANULARITY": "selective",
                                      "RECOMPUTE_MODULES": "core_atn"}, ("'core_atn'",)),
        ("random state abc", {"RANDOM_STATE": "abc"}, (MEG + "RANDOM_STATE", "'abc'")),
        ("expert parallel on a dense model", {"EXPERT_MODEL_PARALLEL_SIZE": "2"},
         (MEG + "EXPERT_MODEL_PARALLEL_SIZE=2",)),
    ]:
        cases.append(Case("env", f"ART_MEGATRON_* {name}", megatron(**env), ValueError,
                          mentions))
    # The CPU default (the segmented flash attention) runs context parallel; Megatron's
    # unfused DotProductAttention refuses it, so this row asks for that build by name.
    cases.append(Case("env", "ART_MEGATRON_* context parallel on the unfused attention",
                      megatron(Implementation.cpu_local("unfused"), CONTEXT_PARALLEL_SIZE="2"),
                      ValueError, (MEG + "CONTEXT_PARALLEL_SIZE=2", "unfused")))
    return cases


# ---------------------------------------------------------------- model folders

def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _make_folders(world: World) -> None:
    """One copy of the good checkpoint per row, broken as the row says (made once, before
    any row runs, so that no row writes a file)."""
    from safetensors.torch import load_file, save_file

    base = world.checkpoint

    def copy(name: str) -> Path:
        folder = world.root / "models" / name
        shutil.copytree(base, folder)
        world.folders[name] = folder
        return folder

    def config(name: str, edit: Callable[[dict], Any] | None = None,
               text: str | None = None) -> None:
        folder = copy(name)
        cfg = _config(folder)
        if edit is not None:
            edit(cfg)
        (folder / "config.json").write_text(text if text is not None else json.dumps(cfg))

    def tensors(name: str, edit: Callable[[dict], Any]) -> None:
        folder = copy(name)
        weights = folder / "model.safetensors"
        loaded = load_file(str(weights))
        edit(loaded)
        save_file(loaded, str(weights), metadata={"format": "pt"})

    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        config(f"no-{field}", lambda c, f=field: c.pop(f))
    config("null-heads", lambda c: c.update(num_attention_heads=None))
    config("heads-eight", lambda c: c.update(num_attention_heads="eight"))
    config("zero-heads", lambda c: c.update(num_attention_heads=0))
    config("negative-layers", lambda c: c.update(num_hidden_layers=-1))
    config("kv-heads-3", lambda c: c.update(num_key_value_heads=3))
    config("not-json", text='{"model_type": "qwen3", ')
    config("empty-config", text="")
    config("json-list", text="[1, 2, 3]")
    config("text-config-5", lambda c: c.update(text_config=5))
    config("hybrid-without-dims", lambda c: c.update(
        layer_types=["linear_attention", "full_attention"]))
    config("gelu", lambda c: c.update(hidden_act="gelu"))
    config("unknown-architecture", lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    (copy("no-config") / "config.json").unlink()
    for weights in copy("no-weights").glob("*.safetensors"):
        weights.unlink()
    cut = copy("truncated") / "model.safetensors"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    index = copy("index-lists-missing-file")
    (index / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    (copy("index-not-json") / "model.safetensors.index.json").write_text("{")
    tensors("missing-tensor", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    tensors("extra-tensor", lambda t: t.update({"model.layers.9.mlp.up_proj.weight":
                                                torch.zeros(2, 2)}))
    tensors("wrong-shape", lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    tensors("int-tensor", lambda t: t.update({"model.norm.weight": torch.ones(
        t["model.norm.weight"].shape, dtype=torch.int32)}))

    def poke(value: float) -> Callable[[dict], None]:
        def edit(t: dict) -> None:
            t["model.layers.1.mlp.up_proj.weight"][3, 5] = value
        return edit

    tensors("nan", poke(float("nan")))
    tensors("inf", poke(float("inf")))
    tensors("overflows-float16", poke(1e30))
    (world.root / "models" / "a-config-file.bin").write_bytes(b"\x00\x01binary")


def pretrained(name: str, dtype: torch.dtype = torch.float32) -> Callable[[World], object]:
    """build_training_runtime on the row's folder, as a driver calls it."""
    def run(world: World) -> object:
        from art.megatron.train import build_training_runtime

        folder = (world.folder(name) if name in world.folders
                  else world.root / "models" / name)
        return build_training_runtime(
            model_identifier=str(folder), model_initialization="pretrained",
            provider_torch_dtype=dtype, build_optimizer=False, print_env=False)
    return run


def _model_cases() -> list[Case]:
    from art.megatron.geometry import ModelConfigError
    from art.megatron.weights.checkpoint import CheckpointError

    rows = [
        *[(f"config without {f}", f"no-{f}", ModelConfigError, (f"'{f}'", "is missing"))
          for f in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")],
        ("heads null", "null-heads", ModelConfigError, ("'num_attention_heads'", "null")),
        ("heads 'eight'", "heads-eight", ModelConfigError, ("'num_attention_heads'", "'eight'")),
        ("heads 0", "zero-heads", ModelConfigError, ("'num_attention_heads'", "is 0")),
        ("layers -1", "negative-layers", ModelConfigError, ("'num_hidden_layers'", "-1")),
        ("KV heads 3 of 8", "kv-heads-3", ModelConfigError, ("'num_key_value_heads'", "is 3")),
        ("config not JSON", "not-json", ModelConfigError, ("config.json", "not valid JSON")),
        ("config empty", "empty-config", ModelConfigError, ("config.json", "not valid JSON")),
        ("config a JSON list", "json-list", ModelConfigError, ("config.json", "JSON list")),
        ("text_config not an object", "text-config-5", ModelConfigError,
         ("'text_config'", "5")),
        ("hybrid without its dims", "hybrid-without-dims", ModelConfigError,
         ("'linear_num_key_heads'", "is missing")),
        ("binary file as config", "a-config-file.bin", ModelConfigError,
         ("a-config-file.bin",)),
        ("folder without config.json", "no-config", ValueError, ("no-config",)),
        ("folder that does not exist", "no-such-folder", ValueError, ("no-such-folder",)),
        ("gelu activation", "gelu", ValueError, ("hidden_act", "'gelu'")),
        ("unsupported architecture", "unknown-architecture", ValueError,
         ("GPT2LMHeadModel",)),
        ("no safetensors", "no-weights", CheckpointError, ("no-weights", "safetensors")),
        ("truncated safetensors", "truncated", CheckpointError,
         ("model.safetensors", "truncated")),
        ("index lists a missing file", "index-lists-missing-file", CheckpointError,
         ("model-00002-of-00002.safetensors",)),
        ("index not JSON", "index-not-json", CheckpointError,
         ("model.safetensors.index.json",)),
        ("missing tensor", "missing-tensor", CheckpointError,
         ("model.layers.1.mlp.up_proj.weight", "missing")),
        ("extra tensor", "extra-tensor", CheckpointError, ("model.layers.9.mlp.up_proj.weight",)),
        ("wrong shape", "wrong-shape", CheckpointError, ("model.norm.weight", "[7]")),
        ("integer tensor", "int-tensor", CheckpointError, ("model.norm.weight", "I32")),
    ]
    cases = [Case("model folder", name, pretrained(folder), error, mentions)
             for name, folder, error, mentions in rows]
    for name, folder, dtype, mentions in [
        ("NaN in a tensor", "nan", torch.float32, ("1 NaN",)),
        ("inf in a tensor", "inf", torch.float32, ("1 inf",)),
        ("a weight beyond float16", "overflows-float16", torch.float16, ("range of float16",)),
    ]:
        cases.append(Case("model folder", name, pretrained(folder, dtype), CheckpointError,
                          ("model.layers.1.mlp.up_proj.weight", "model.safetensors",
                           *mentions), before_build=False))
    return cases


# ---------------------------------------------------------------- items

def x(n: int = 6, **kw: Any) -> ForwardInput:
    kw.setdefault("target_tokens", torch.arange(n) % VOCAB)
    return ForwardInput(input_tokens=torch.arange(n) % VOCAB, **kw)


def forward(build: Callable[[], Any], **kw: Any) -> Callable[[World], object]:
    def run(world: World) -> object:
        return list(world.trainer.forward_micro_batches(build(), **kw))
    return run


def dp_forward(build: Callable[[], Any], **kw: Any) -> Callable[[World], object]:
    def run(world: World) -> object:
        return world.trainer.dp_rank_forward(build(), **kw)
    return run


def _with(tokens: list[int] | None = None, targets: Any = None, **kw: Any) -> ForwardInput:
    ids = torch.tensor(tokens if tokens is not None else [1, 2, 3, 4])
    return ForwardInput(input_tokens=ids, target_tokens=None if targets is None else
                        torch.tensor(targets), **kw)


def _item_cases() -> list[Case]:
    out_of_range = ("the model's vocabulary has 256 ids",)
    rows: list[tuple[str, Callable[[World], object], type[BaseException], tuple[str, ...]]] = [
        ("input id = vocab", forward(lambda: [x(), _with([1, 256, 3], [1, 2, 3])]), ValueError,
         ("inputs[1].input_tokens", "256", "position 1", *out_of_range)),
        ("negative input id", forward(lambda: [_with([1, -1, 3], [1, 2, 3])]), ValueError,
         ("inputs[0].input_tokens", "-1", *out_of_range)),
        ("input id past the vocabulary in a nested group",
         forward(lambda: [[x(), [x(), _with([70000], [1])]]]), ValueError,
         ("inputs[0][1][1].input_tokens", "70000")),
        ("target = vocab", forward(lambda: [_with([1, 2, 3], [1, 256, -100])]), ValueError,
         ("inputs[0].target_tokens", "256", "-100 to skip")),
        ("target -5", forward(lambda: [_with([1, 2, 3], [-5, 1, 2])]), ValueError,
         ("inputs[0].target_tokens", "-5")),
        ("target -101", forward(lambda: [_with([1, 2, 3], [-101, 1, 2])]), ValueError,
         ("inputs[0].target_tokens", "-101")),
        ("[T, k] targets past the vocabulary",
         forward(lambda: [_with([1, 2], [[1, 2], [3, 999]])]), ValueError,
         ("inputs[0].target_tokens", "999", "target 1")),
        ("top_k one past the vocabulary", forward(lambda: [x(top_k=257)]), ValueError,
         ("inputs[0]", "top_k=257", "256 ids")),
        ("top_k 999999 in a group", forward(lambda: [x(), [x(), x(top_k=999999)]]), ValueError,
         ("inputs[1][1]", "top_k=999999")),
        ("grad item requesting no output", forward(lambda: [ForwardInput(
            input_tokens=torch.tensor([1, 2, 3]))]), ValueError,
         ("inputs[0]", "requests no output", "no_grad=True")),
        ("grad group requesting no output", forward(lambda: [x(), [
            ForwardInput(input_tokens=torch.tensor([1, 2])),
            ForwardInput(input_tokens=torch.tensor([3]))]]), ValueError,
         ("inputs[1]", "every sequence of the group", "requests no output")),
        ("dp_rank_forward: grad item requesting no output", dp_forward(lambda: [
            ForwardInput(input_tokens=torch.tensor([5, 6]), no_grad=False)]), ValueError,
         ("inputs[0]", "requests no output")),
        ("dp_rank_forward: input id past the vocabulary",
         dp_forward(lambda: [_with([300], [1])], no_grad=True), ValueError,
         ("inputs[0].input_tokens", "300")),
        ("the head probe asked for a grad tail with no output",
         lambda w: w.trainer.probe.tail_cost(OutputRequest(), True, 64), ValueError,
         ("outputs 'none'", "requests no output")),
        ("groups nested five deep", forward(lambda: [[[[[x()]]]]]), ValueError,
         ("inputs[0]", "deeper than 4 levels")),
        ("empty group", forward(lambda: [x(), []]), ValueError, ("inputs[1]", "empty group")),
        ("an item that is an int", forward(lambda: [x(), 7]), TypeError,
         ("inputs[1]", "int")),
        ("a single ForwardInput for the list", forward(lambda: x()), TypeError,
         ("ForwardInput", "wrap")),
        ("a checkpoint that is not loaded", forward(lambda: [x()], checkpoint="/no/such/ckpt"),
         TrainerRankSlotStateError, ("'/no/such/ckpt'", "not a resident slot")),
        ("float token ids", lambda w: ForwardInput(input_tokens=torch.tensor([1.5, 2.0])),
         ValueError, ("input_tokens", "torch.float32")),
        ("no tokens", lambda w: ForwardInput(input_tokens=torch.tensor([], dtype=torch.long)),
         ValueError, ("input_tokens", "empty")),
        ("tokens shaped [2, 3]", lambda w: ForwardInput(input_tokens=torch.zeros(2, 3,
                                                                                 dtype=torch.long)),
         ValueError, ("input_tokens", "(2, 3)")),
        ("targets of another length", lambda w: _with([1, 2, 3], [1, 2]), ValueError,
         ("target_tokens", "T = 3", "(2,)")),
        ("float targets", lambda w: ForwardInput(input_tokens=torch.tensor([1, 2]),
                                                 target_tokens=torch.tensor([0.5, 1.0])),
         ValueError, ("target_tokens", "torch.float32")),
        ("top_k 0", lambda w: x(top_k=0), ValueError, ("top_k", "got 0")),
        ("top_k True", lambda w: x(top_k=True), ValueError, ("top_k", "True")),
        ("no_grad 'yes'", lambda w: x(no_grad="yes"), ValueError, ("no_grad", "'yes'")),
        ("tokens as a list", lambda w: ForwardInput(input_tokens=[1, 2, 3]), ValueError,
         ("input_tokens", "list")),
    ]
    return [Case("items", name, run, error, mentions) for name, run, error, mentions in rows]


# ---------------------------------------------------------------- the command line

def _cli_cases() -> list[Case]:
    base = ("--model", "Qwen3-8B", "--tokens", "100")
    est = ("estimate", *base)
    plan = ("plan", *base, "--gpus", "2", "--gpu", "H200")

    def run(*argv: str, env: dict[str, str] | None = None) -> Callable[[World], object]:
        def go(world: World) -> object:
            args = [a.format(folder=world.folder("no-num_attention_heads"),
                             not_json=world.folder("not-json")) for a in argv]
            return cli(*args, env=env)
        return go

    rows: list[tuple[str, Callable[[World], object], int, tuple[str, ...]]] = [
        ("estimate --tp 3 on 32 heads", run(*est, "--tp", "3"), 2,
         ("--tp=3", "num_attention_heads=32")),
        ("estimate --tp 0", run(*est, "--tp", "0"), 2, ("--tp='0'", ">= 1")),
        ("estimate --tp -1", run(*est, "--tp", "-1"), 2, ("--tp='-1'",)),
        ("estimate --tp abc", run(*est, "--tp", "abc"), 2, ("--tp='abc'",)),
        ("estimate --outputs top_k=999999", run(*est, "--outputs", "top_k=999999"), 2,
         ("--outputs", "top_k=999999", "151936")),
        ("estimate --outputs bogus", run(*est, "--outputs", "logprobs,bogus"), 2,
         ("--outputs", "'bogus'")),
        ("estimate --outputs none with grad", run(*est, "--outputs", "none"), 2,
         ("--outputs 'none'", "--no-grad")),
        ("estimate --lora-rank -1", run(*est, "--lora-rank", "-1"), 2, ("--lora-rank -1",)),
        ("estimate --resident-adapters -2", run(*est, "--resident-adapters", "-2"), 2,
         ("--resident-adapters -2",)),
        ("estimate --packed-tokens 0", run(*est, "--packed-tokens", "0"), 2,
         ("--packed-tokens 0",)),
        ("estimate --packed-tokens above the sequences", run(*est, "--packed-tokens", "101"),
         2, ("--packed-tokens 101", "to 100")),
        ("estimate selective with --recompute-num-layers",
         run(*est, "--recompute", "selective", "--recompute-num-layers", "2"), 2,
         ("--recompute-num-layers=2", "selective")),
        ("estimate --recompute-num-layers 5 of 36 layers",
         run(*est, "--recompute", "full", "--recompute-num-layers", "5"), 2,
         ("--recompute-num-layers=5", "36")),
        ("estimate --recompute sometimes", run(*est, "--recompute", "sometimes"), 2,
         ("--recompute='sometimes'",)),
        ("estimate --recompute-modules core_atn",
         run(*est, "--recompute", "selective", "--recompute-modules", "core_atn"), 2,
         ("--recompute-modules", "'core_atn'")),
        ("estimate --cp 2 on the local spec", run(*est, "--cp", "2", "--attention", "unfused"),
         2, ("--cp=2", "unfused DotProductAttention", "segmented flash attention")),
        ("estimate --ep 2 on a dense model", run(*est, "--ep", "2"), 2, ("--ep=2", "no MoE")),
        ("estimate --pp 5 on 36 layers", run(*est, "--pp", "5"), 2, ("--pp=5", "36 layers")),
        ("estimate --sp at TP 1", run(*est, "--sp"), 2, ("--sp=true", "TENSOR_MODEL_PARALLEL")),
        ("estimate --tokens -5", run("estimate", "--model", "Qwen3-8B", "--tokens", "-5"), 2,
         ("--tokens -5",)),
        ("estimate --tokens 0", run("estimate", "--model", "Qwen3-8B", "--tokens", "0"), 2,
         ("--tokens 0",)),
        ("estimate --sequences 10,0", run("estimate", "--model", "Qwen3-8B", "--sequences",
                                          "10,0"), 2, ("--sequences 10,0",)),
        ("estimate --sequences a,b", run("estimate", "--model", "Qwen3-8B", "--sequences",
                                         "a,b"), 2, ("--sequences", "'a,b'")),
        ("estimate --shared-prefix above the shortest",
         run("estimate", "--model", "Qwen3-8B", "--sequences", "10,20", "--shared-prefix",
             "50"), 2, ("--shared-prefix 50", "10 tokens")),
        ("estimate --shared-prefix without a group", run(*est, "--shared-prefix", "5"), 2,
         ("--shared-prefix 5", "group")),
        ("estimate --packed-tokens contradicting --shared-prefix",
         run("estimate", "--model", "Qwen3-8B", "--sequences", "10,20", "--shared-prefix",
             "5", "--packed-tokens", "20"), 2, ("--packed-tokens 20", "--shared-prefix 5")),
        ("estimate --model that does not exist",
         run("estimate", "--model", "no-such-model", "--tokens", "10"), 2, ("no-such-model",)),
        ("estimate --model without a config field",
         run("estimate", "--model", "{folder}", "--tokens", "10"), 2,
         ("no-num_attention_heads", "'num_attention_heads'", "is missing")),
        ("estimate --model whose config is not JSON",
         run("estimate", "--model", "{not_json}", "--tokens", "10"), 2,
         ("not-json", "not valid JSON")),
        ("estimate --gpu-memory 0", run(*est, "--gpu-memory", "0"), 2, ("--gpu-memory", "'0'")),
        ("estimate --gpu-memory 12XB", run(*est, "--gpu-memory", "12XB"), 2,
         ("--gpu-memory", "'12XB'")),
        ("estimate --dtype float8", run(*est, "--dtype", "float8"), 2, ("--dtype", "'float8'")),
        ("estimate with a bad ART_MEGATRON_* value", run(*est, env={
            MEG + "TENSOR_MODEL_PARALLEL_SIZE": "abc"}), 2,
         (MEG + "TENSOR_MODEL_PARALLEL_SIZE='abc'",)),
        ("estimate that does not fit --gpu-memory", run(*est, "--gpu-memory", "1MiB"), 3,
         ("DOES NOT FIT",)),
        ("plan --gpus 0", run("plan", *base, "--gpus", "0", "--gpu", "H200"), 2,
         ("--gpus 0",)),
        ("plan --gpus -2", run("plan", *base, "--gpus", "-2", "--gpu", "H200"), 2,
         ("--gpus -2",)),
        ("plan --outputs top_k=999999", run(*plan, "--outputs", "top_k=999999"), 2,
         ("--outputs", "top_k=999999")),
        ("plan --packed-tokens 0", run(*plan, "--packed-tokens", "0"), 2,
         ("--packed-tokens 0",)),
        ("plan --tokens -5", run("plan", "--model", "Qwen3-8B", "--tokens", "-5", "--gpus", "2",
                                 "--gpu", "H200"), 2, ("--tokens -5",)),
        ("plan --lora-rank -1", run(*plan, "--lora-rank", "-1"), 2, ("--lora-rank -1",)),
        ("plan --gpu H300", run("plan", *base, "--gpus", "2", "--gpu", "H300"), 2,
         ("--gpu", "'H300'")),
        ("plan --model that does not exist",
         run("plan", "--model", "no-such-model", "--tokens", "10", "--gpus", "2", "--gpu",
             "H200"), 2, ("no-such-model",)),
        ("plan with a bad ART_MEGATRON_* value", run(*plan, env={
            MEG + "RECOMPUTE_GRANULARITY": "partial"}), 2,
         (MEG + "RECOMPUTE_GRANULARITY='partial'",)),
        ("plan where nothing fits", run("plan", *base, "--gpus", "2", "--gpu-memory", "1MiB"),
         3, ("nothing fits",)),
    ]
    return [Case("CLI", name, go, Refused, mentions, status=status)
            for name, go, status, mentions in rows]


# ---------------------------------------------------------------- the demo's flags

def _demo_cases() -> list[Case]:
    def run(*argv: str, **env: str) -> Callable[[World], object]:
        return lambda world: demo(*argv, env=env)

    rows: list[tuple[str, Callable[[World], object], tuple[str, ...]]] = [
        ("--groups 0", run("--groups", "0"), ("--groups=0",)),
        ("--groups -1", run("--groups", "-1"), ("--groups=-1",)),
        ("--rollouts 0", run("--rollouts", "0"), ("--rollouts=0",)),
        ("--max-tokens 40", run("--max-tokens", "40"), ("--max-tokens=40", "--min-tokens=64")),
        ("--min-tokens 1", run("--min-tokens", "1"), ("--min-tokens=1",)),
        ("--min-tokens above --max-tokens", run("--min-tokens", "2000"),
         ("--min-tokens=2000", "--max-tokens=1500")),
        ("--median-completion 0", run("--median-completion", "0"), ("--median-completion=0",)),
        ("--limit-mib 0", run("--limit-mib", "0"), ("--limit-mib=0",)),
        ("--limit-mib -1", run("--limit-mib", "-1"), ("--limit-mib=-1",)),
        ("--limit-mib nan", run("--limit-mib", "nan"), ("--limit-mib=nan",)),
        ("--limit-mib inf", run("--limit-mib", "inf"), ("--limit-mib=inf",)),
        ("--limit-mib beyond the machine's memory", run("--limit-mib", "100000000"),
         ("--limit-mib=1e+08", "available memory")),
        ("--lora-rank 0", run("--lora-rank", "0"), ("--lora-rank=0",)),
        ("--lora-rank -3", run("--lora-rank", "-3"), ("--lora-rank=-3",)),
        ("--groups abc", run("--groups", "abc"), ("--groups", "'abc'")),
        ("an unknown flag", run("--bogus"), ("--bogus",)),
        ("a bad ART_TRAINER_RANK_* value", run(**{ENV + "TRUST_WINDOW": "x"}),
         (ENV + "TRUST_WINDOW='x'",)),
        ("a bad ART_MEGATRON_* value", run(**{MEG + "TENSOR_MODEL_PARALLEL_SIZE": "0"}),
         (MEG + "TENSOR_MODEL_PARALLEL_SIZE='0'",)),
        ("a virtual limit beyond the machine's memory",
         run(**{ENV_TEST_MEMORY_LIMIT: "1e15"}), (ENV_TEST_MEMORY_LIMIT + "='1e15'",
                                                  "available memory")),
    ]
    return [Case("demo", name, go, Refused, mentions, status=2) for name, go, mentions in rows]


CASES = [*_env_cases(), *_model_cases(), *_item_cases(), *_cli_cases(), *_demo_cases()]
COUNTS: Counter = Counter()


@pytest.fixture(scope="module")
def world(tmp_path_factory, megatron_process) -> World:
    from _hf_models import save_hf_model

    root = tmp_path_factory.mktemp("hostile")
    checkpoint = save_hf_model("qwen3", tmp_path_factory.mktemp("hf") / "qwen3", vocab=VOCAB)
    made = World(root, checkpoint)
    _make_folders(made)
    return made


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """Every Megatron model built during the row (the builder still runs)."""
    built: list[str] = []
    original = model_builder.build_gpt_model

    def build(*args: Any, **kwargs: Any) -> Any:
        built.append("model")
        return original(*args, **kwargs)

    monkeypatch.setattr(model_builder, "build_gpt_model", build)
    return built


@pytest.mark.parametrize("case", CASES, ids=[f"{c.category}: {c.name}" for c in CASES])
def test_hostile_input_is_refused_by_name_and_changes_nothing(case: Case, world: World,
                                                              builds: list[str]) -> None:
    if case.category == "items":
        assert world.trainer is not None  # built first: its state is compared too
    built_before = len(builds)
    before = world.state()
    if case.warns:
        with pytest.warns(case.error) as caught:
            case.run(world)
        message = str(caught[0].message)
    else:
        with pytest.raises(case.error) as raised:
            case.run(world)
        message = str(raised.value)
        if case.status is not None:
            assert raised.value.status == case.status, (raised.value.status, message)
    for needle in case.mentions:
        assert needle in message, f"{needle!r} not in: {message}"
    assert "\n" not in message.strip(), f"not one line: {message}"
    assert "Traceback" not in message
    if case.before_build:
        assert len(builds) == built_before, f"a model was built before the error: {message}"
    after = world.state()
    assert after == before, _difference(before, after)
    COUNTS[case.category] += 1


def _difference(before: dict, after: dict) -> str:
    changed = [k for k in before if before[k] != after.get(k)]
    detail: dict[str, Any] = {}
    for k in changed:
        old, new = before[k], after.get(k)
        if isinstance(old, dict) and isinstance(new, dict):
            detail[k] = {key: (old.get(key), new.get(key)) for key in {*old, *new}
                         if old.get(key) != new.get(key)}
        else:
            detail[k] = {"before": old, "after": new}
    if "trainer" in changed:
        detail["trainer"] = [k for k in before["trainer"]
                             if before["trainer"][k] != after["trainer"][k]]
    return f"state changed: {json.dumps(detail, default=str)[:2000]}"


def test_the_table_holds_at_least_100_hostile_inputs() -> None:
    by_category = Counter(c.category for c in CASES)
    assert sum(by_category.values()) >= 100, by_category
    assert set(by_category) == {"env", "model folder", "items", "CLI", "demo"}
    write_counts("hostile_inputs", {**by_category, "total": sum(by_category.values()),
                                    "passed": sum(COUNTS.values())})


def test_demo_help_prints_once_and_at_once() -> None:
    """--help is answered by the launcher alone: once, and without importing torch or
    Megatron-Core (what made it slow) or starting torchrun."""
    proc = subprocess.run([str(ROOT / "scripts" / "demo"), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage:") == 1, proc.stdout
    assert "--groups" in proc.stdout and "--limit-mib" in proc.stdout
    probe = ("import runpy, sys\n"
             "sys.argv = ['demo_launch.py', '--help']\n"
             "try:\n    runpy.run_path('scripts/demo_launch.py', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print(sorted(m for m in ('torch', 'megatron.core', 'torch.distributed.run')"
             " if m in sys.modules))\n")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().splitlines()[-1] == "[]", imported.stdout


def test_a_bad_demo_flag_stops_before_torchrun() -> None:
    proc = subprocess.run([str(ROOT / "scripts" / "demo"), "--groups", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip() == "demo: --groups=0: a workload needs at least one group (prompt)"
    assert "torch.distributed" not in proc.stderr and proc.stdout == ""
