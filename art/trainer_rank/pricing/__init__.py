"""Pricing: what a micro-batch costs, as named terms (layers, model, passes, tail, adapters)."""
