"""torchrun worker: five calibration cells at TP=2; each rank writes its measured vs predicted
and stores its probe in <out>/probes/rank<R>; then, given a second folder, the CP=2 cells of
calibration_cp2_worker.py (one launch for test_calibration_tp2.py and test_calibration_cp2.py,
conftest.py's calibration_launch)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _calibration.harness import Cell  # noqa: E402
from _calibration_runs import measure_on_this_rank  # noqa: E402

PROBE_TOKENS = (64, 128, 192, 256, 320, 384)


def main() -> None:
    """argv: out_dir, then optionally the CP=2 cells' out_dir: calibration_cp2_worker.py's
    cells run after these in the same launch, on Megatron's parallel state rebuilt at CP=2."""
    run(Path(sys.argv[1]))
    if len(sys.argv) > 2:
        import calibration_cp2_worker
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        calibration_cp2_worker.run(Path(sys.argv[2]))


def run(out_dir: Path) -> None:
    """Measure the cells on this rank at TP=2; its rows and probe to out_dir."""
    cells = [
        Cell("gqa-128", "selective default", 8, 2, (128, 192), "logprobs", True),
        Cell("gqa-128", "selective default", 8, 2, (320,), "top_k=20", False),
        # Full logits: the TP all-gather of each chunk is live at the head's forward peak.
        Cell("gqa-128", "selective default", 8, 2, (136,), "logits", True),
        Cell("gqa-128", "selective default", 8, 2, (342,), "logits", False),
        # Full logits on a row sharing a prompt: the gather is live at the head's moment, the
        # per-sequence copies after it, never both.
        Cell("gqa-128", "selective default", 8, 2, (2, 329), "logits", True, shared_prefix=1),
    ]
    measure_on_this_rank(out_dir, cells, tensor_parallel=2, probe_tokens=PROBE_TOKENS)


if __name__ == "__main__":
    main()
