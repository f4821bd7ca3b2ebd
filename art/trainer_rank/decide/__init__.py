"""Decisions: admission (which items run next, under which recompute), learned profiles,
full recompute for one micro-batch (escalation), which layouts TrainerRank runs."""
