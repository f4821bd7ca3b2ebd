"""Measuring: the meter, the device's usable limit, the layer probe and its store, and the memory
models a TrainerRank prices with once its probe has run."""
