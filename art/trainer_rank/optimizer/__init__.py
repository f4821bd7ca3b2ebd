"""The optimizer step: gradients finalised over the data-parallel ranks, the caller's scale,
Adam on the runtime's optimizer and on each loaded slot, zeroing, and the live graphs a step
may refuse to run under."""
