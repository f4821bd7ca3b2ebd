"""Ranks in step: the agreeing collectives, the per-phase protocol, data-parallel waves."""
