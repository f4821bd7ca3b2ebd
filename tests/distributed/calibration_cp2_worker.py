"""torchrun worker: calibration cells at TP=1 x CP=2 (the segmented flash attention over a
split row), dense and hybrid; each rank writes its measured vs predicted and stores its probe in
<out>/probes/rank<R>. The suite runs `run` after calibration_tp2_worker.py's cells, in its
launch."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _calibration.harness import Cell  # noqa: E402
from _calibration_runs import measure_on_this_rank  # noqa: E402

from art.trainer_rank.pricing.chunked import with_points_inside_chunks  # noqa: E402

# Per CP rank (rows of twice as many tokens; a Gated DeltaNet layer's points are whole rows),
# with the points inside a chunk its fit needs.
PROBE_TOKENS = with_points_inside_chunks((64, 128, 192, 256, 320, 384))


def main() -> None:
    run(Path(sys.argv[1]))


def run(out_dir: Path) -> None:
    """Measure the cells on this rank at TP=1 x CP=2; its rows and probe to out_dir."""
    cp = dict(context_parallel=2)
    cells = [
        Cell("gqa-128", "selective default", 8, 1, (150, 231), "logprobs", True, **cp),
        # A group sharing its prompt: the tree is split over the ranks like any row, and the
        # rows where the rollouts diverge are scored again with each one's target.
        Cell("gqa-128", "selective default", 8, 1, (300, 190, 41), "logprobs", True,
             shared_prefix=37, **cp),
        Cell("gqa-128", "selective default", 8, 1, (503,), "top_k=20", False, **cp),
        # Top-k of a group sharing its prompt, peaking at the head's backward: the head keeps
        # the row's top-k ids for it beside the rollouts' copies.
        Cell("gqa-128", "selective default", 8, 1, (6, 305, 384, 6), "top_k=20", True,
             shared_prefix=5, **cp),
        Cell("gqa-128", "selective default", 8, 1, (270,), "logits", True, **cp),
        # Hidden states with grad: the caller's mean-square backward meets the final norm's,
        # which runs on this rank's rows before the row is gathered.
        Cell("gqa-128", "selective default", 8, 1, (161, 202), "hidden_states", True, **cp),
        # The hybrid: its Gated DeltaNet layers run the whole row gathered on every CP rank.
        Cell("hybrid-128", "selective default", 8, 1, (150, 231), "logprobs", True, **cp),
        Cell("hybrid-128", "selective default", 8, 1, (300, 190, 41), "logprobs", True,
             shared_prefix=37, **cp),
        Cell("hybrid-128", "selective default", 8, 1, (503,), "top_k=20", False, **cp),
        # Peaking at the head's backward beside every layer's kept activations: a Gated
        # DeltaNet layer keeps the gathered whole row (its input norm runs after the gather),
        # not its own rows.
        Cell("hybrid-128", "selective default", 8, 1, (588,), "logits", True, **cp),
    ]
    measure_on_this_rank(out_dir, cells, context_parallel=2, probe_tokens=PROBE_TOKENS)


if __name__ == "__main__":
    main()
