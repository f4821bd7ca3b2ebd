"""The memory model: pricing (layers, model, estimate, adapters), probe, budget, meters."""
