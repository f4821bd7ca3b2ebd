"""A valid value for every ART_MEGATRON_* name upstream's provider and train.py read, and a
context that sets environment variables for a while."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

UPSTREAM_ENV = {
    "ART_MEGATRON_TENSOR_MODEL_PARALLEL_SIZE": "1",
    "ART_MEGATRON_CONTEXT_PARALLEL_SIZE": "1",
    "ART_MEGATRON_PIPELINE_MODEL_PARALLEL_SIZE": "1",
    "ART_MEGATRON_VIRTUAL_PIPELINE_MODEL_PARALLEL_SIZE": "none",
    "ART_MEGATRON_VPP_MICROBATCH_GROUP_SIZE": "2",
    "ART_MEGATRON_EXPERT_MODEL_PARALLEL_SIZE": "1",
    "ART_MEGATRON_EXPERT_TENSOR_MODEL_PARALLEL_SIZE": "1",
    "ART_MEGATRON_RECOMPUTE_GRANULARITY": "full",
    "ART_MEGATRON_RECOMPUTE_METHOD": "uniform",
    "ART_MEGATRON_RECOMPUTE_NUM_LAYERS": "1",
    "ART_MEGATRON_RECOMPUTE_MODULES": "disable",
    "ART_MEGATRON_MOE_ROUTER_DTYPE": "fp32",
    "ART_MEGATRON_OFFLOAD_MODULES": "",
    "ART_MEGATRON_OVERLAP_MOE_EXPERT_PARALLEL_COMM": "false",
    "ART_MEGATRON_DELAY_WGRAD_COMPUTE": "0",
    "ART_MEGATRON_EP_OVERLAP_EARLY_ATTN_MEMORY_RELEASE": "off",
    "ART_MEGATRON_MOE_APPLY_PROBS_ON_INPUT": "no",
    "ART_MEGATRON_BIAS_ACTIVATION_FUSION": "true",
    "ART_MEGATRON_FINE_GRAINED_ACTIVATION_OFFLOADING": "false",
    "ART_MEGATRON_MOE_SHARED_EXPERT_OVERLAP": "false",
    "ART_MEGATRON_MOE_HYBRIDEP_NUM_SMS": "default",
    "ART_MEGATRON_RANDOM_STATE": "3",
    "ART_MEGATRON_ENABLE_MOE_ROUTING_REPLAY": "false",
}


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `values` set, and as it was before (every variable) afterwards."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)

