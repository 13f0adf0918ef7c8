"""Llama in Flax NNX: presets, weights, tokenizer, sampling, serving entry points."""

from jaxdisagg.model.config import PRESETS, LlamaConfig, RopeScaling, get_preset
from jaxdisagg.model.llama import Llama
from jaxdisagg.model.paged import KVLayout, KVPages, decode_step, jit_serving_fns, prefill_chunk
from jaxdisagg.model.reference import ReferenceGenerator
from jaxdisagg.model.sampling import SamplingParams

__all__ = [
    "PRESETS", "KVLayout", "KVPages", "Llama", "LlamaConfig", "ReferenceGenerator",
    "RopeScaling", "SamplingParams", "decode_step", "get_preset", "jit_serving_fns",
    "prefill_chunk",
]
