"""The probe is paid once: TrainerRank caches it on disk by default (the user cache folder, or
beside the profile file, or a named directory) and a later job reuses it only when the same
software measured the same model, layout and policy; anything else measures again."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from _trainer_helpers import provider

from art.megatron.train import TrainingRuntime
from art.trainer_rank import TrainerRank, TrainerRankOptions
from art.trainer_rank._request import MicroBatchShape, OutputRequest
from art.trainer_rank.measuring import probe as probe_module
from art.trainer_rank.measuring import probe_runs, probe_store

LIMIT = 16 * 2**20


@pytest.fixture()
def measured(monkeypatch):
    """Counts the layer measurements the probe makes; the in-process copy of earlier probes is
    set aside, so that what a new process would find on disk is what counts."""
    monkeypatch.setattr(probe_module, "_CACHE", {})
    monkeypatch.setattr(probe_module, "_PARTS", {})
    calls = []
    real = probe_runs.measure_mode

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(probe_module, "measure_mode", counting)
    return calls


def _trainer(p, model, **options) -> TrainerRank:
    """A new job's trainer after its first grad micro-batch was priced: the configured
    policy's grad modes are probed then (or read from the cache)."""
    probe_module.forget_in_process_probes()
    trainer = TrainerRank(TrainingRuntime.for_model(model, p, trainer_options=TrainerRankOptions(
        test_memory_limit_bytes=LIMIT, **options)))
    assert trainer.probe is not None and trainer.probe.layers.layers == ()
    trainer.memory_model.estimate(MicroBatchShape(
        (64,), outputs=OutputRequest(target_logprobs=True), grad_enabled=True))
    return trainer


def test_a_second_job_reuses_the_probe_from_the_user_cache_folder(built, measured, tmp_path,
                                                                   monkeypatch):
    p, model = built
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = _trainer(p, model)
    folder = tmp_path / "cache" / "art-trainer-rank" / "probes"
    stored = {s.name: s for s in folder.glob("probe-*.json")}
    # The grad modes' layers, and the head tail of the priced output mix.
    assert len(stored) == 2 and f"probe-{first.probe.key}.json" in stored
    assert len(measured) > 0
    record = json.loads(stored[f"probe-{first.probe.key}.json"].read_text())
    assert record["software"] == probe_store.software_fingerprint("cpu")

    measured.clear()
    second = _trainer(p, model)
    assert measured == [] and second.probe.key == first.probe.key
    assert second.probe.layers == first.probe.layers


def test_a_probe_measured_by_other_software_is_measured_again(built, measured, tmp_path,
                                                              monkeypatch):
    p, model = built
    first = _trainer(p, model, probe_cache_dir=str(tmp_path))
    path = probe_store.probe_file(tmp_path, first.probe.key)
    record = json.loads(path.read_text())
    record["software"] = "another-build"
    path.write_text(json.dumps(record))
    measured.clear()
    _trainer(p, model, probe_cache_dir=str(tmp_path))
    assert len(measured) > 0
    assert json.loads(path.read_text())["software"] == probe_store.software_fingerprint("cpu")

    # An edit to the package's source is other software too.
    probe_store.software_fingerprint.cache_clear()
    monkeypatch.setattr(probe_store, "_source_digest", lambda: "edited-source")
    try:
        measured.clear()
        _trainer(p, model, probe_cache_dir=str(tmp_path))
        assert len(measured) > 0
    finally:
        probe_store.software_fingerprint.cache_clear()


def test_a_damaged_cache_file_is_measured_again_and_replaced(built, measured, tmp_path):
    p, model = built
    first = _trainer(p, model, probe_cache_dir=str(tmp_path))
    path = probe_store.probe_file(tmp_path, first.probe.key)
    whole = path.read_text()
    for damaged in (whole[: len(whole) // 2], "[]",
                    json.dumps({"software": probe_store.software_fingerprint("cpu")})):
        path.write_text(damaged)
        measured.clear()
        trainer = _trainer(p, model, probe_cache_dir=str(tmp_path))
        assert len(measured) > 0
        assert _measured_bytes(trainer.probe.layers) == _measured_bytes(first.probe.layers)
        assert probe_store.stored_probe_text(tmp_path, first.probe.key, "cpu") is not None


def test_cache_off_keeps_the_probe_in_memory(built, measured, tmp_path, monkeypatch):
    p, model = built
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ART_TRAINER_RANK_PROBE_CACHE", "false")
    options = TrainerRankOptions.from_env()
    assert options.probe_cache is False and options.resolved_probe_cache_dir() is None
    _trainer(p, model, probe_cache=False, probe_cache_dir=str(tmp_path / "named"))
    assert len(measured) > 0 and list(tmp_path.rglob("probe-*.json")) == []
    monkeypatch.setenv("ART_TRAINER_RANK_PROBE_CACHE", "often")
    with pytest.raises(ValueError, match="ART_TRAINER_RANK_PROBE_CACHE='often'"):
        TrainerRankOptions.from_env()


def test_an_unwritable_cache_never_stops_a_run(built, measured, tmp_path, monkeypatch):
    p, model = built
    # The default folder under a regular file cannot be created: warned, kept in memory.
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.warns(UserWarning, match="kept in memory"):
        assert TrainerRankOptions().resolved_probe_cache_dir() is None
    # A directory that stops being writable after the options were checked: warned at the
    # write, and the run goes on with the probe it measured.
    named = tmp_path / "named"
    monkeypatch.setattr(probe_store.Path, "replace", _refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(p, model, probe_cache_dir=str(named))
    assert trainer.probe is not None and len(measured) > 0
    assert any("not cached" in str(w.message) for w in caught)
    assert not any(name.endswith(".json") for name in os.listdir(named))


def _measured_bytes(coefficients) -> list:
    """The bytes each probed layer measured (a least-squares fit of the same points may
    differ in its last bits from run to run)."""
    return [(kind, mode, q, getattr(fit, q).values) for kind, mode, fit in coefficients.layers
            for q in ("kept", "forward", "backward", "output")]


def _refuse(self, target):
    raise PermissionError(13, "Permission denied", str(target))


def test_a_probe_for_another_policy_measures_only_the_parts_this_process_has_not(
        built, measured):
    """Within one process a probe reuses the layer modes and tails an earlier probe of the same
    model, layout and build measured (the ladder's rungs make most of them common to every
    policy); what it reuses equals what it would measure."""
    p, model = built
    full = provider("full", ART_MEGATRON_RECOMPUTE_METHOD="uniform",
                    ART_MEGATRON_RECOMPUTE_NUM_LAYERS="1")
    _price(_trainer(p, model, probe_cache=False), grad=False)
    measured.clear()
    second = TrainerRank(TrainingRuntime.for_model(model, full, trainer_options=TrainerRankOptions(
        test_memory_limit_bytes=LIMIT, probe_cache=False)))
    # Full recompute's no-grad modes are selective's: reused whole. Its grad modes are
    # others, measured now.
    _price(second, grad=False)
    assert measured == []
    _price(second, grad=True)
    reused = len(measured)
    measured.clear()
    probe_module._PARTS.clear()
    probe_module.forget_in_process_probes()
    fresh = TrainerRank(TrainingRuntime.for_model(model, full, trainer_options=TrainerRankOptions(
        test_memory_limit_bytes=LIMIT, probe_cache=False)))
    _price(fresh, grad=False)
    _price(fresh, grad=True)
    assert 0 < reused < len(measured), (reused, len(measured))
    assert second.probe.key == fresh.probe.key
    # The measured bytes are equal; the fits through them agree to the last bits a threaded
    # least-squares solve leaves.
    assert _measured(second.probe.layers.layers) == _measured(fresh.probe.layers.layers)


def _price(trainer: TrainerRank, grad: bool) -> None:
    """Price one micro-batch, as a call's plan does (probing what it needs first)."""
    trainer.memory_model.estimate(MicroBatchShape(
        (64,), outputs=OutputRequest(target_logprobs=True), grad_enabled=grad))


def _measured(layers) -> dict:
    return {(kind, mode): {q: (getattr(fit, q).tokens, getattr(fit, q).values)
                           for q in ("kept", "forward", "backward", "output")}
            for kind, mode, fit in layers}
