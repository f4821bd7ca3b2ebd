"""The command line, `python -m art.trainer_rank`: `estimate` (one micro-batch's itemised peak
per rank) and `plan` (every recompute policy x parallel layout for a GPU count)."""
