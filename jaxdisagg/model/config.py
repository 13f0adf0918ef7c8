"""Llama model shapes as literal frozen dataclasses, and the published presets.

A `LlamaConfig` holds shapes only; the compute dtype is chosen when the model is
built, so one preset serves fp32 tests on CPU and bf16 serving on GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads sharing one KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count, as the roofline's Π (the embedding counted once if tied)."""
        d, f, k = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * k * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def kv_bytes_per_token(self, bytes_per_elem: int) -> int:
        """K_tok: K and V bytes for one token summed over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_elem

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)


# Byte-level vocabulary of the random presets: ids 0-255 are bytes, then specials.
# Padded to 384 so the vocabulary divides every tensor-parallel degree we ship.
BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258
BYTE_VOCAB_SIZE = 384

PRESETS: dict[str, LlamaConfig] = {
    # The default: small enough that the whole suite runs on 2 CPU cores, yet with
    # GQA (2 KV heads), several layers (for layer streaming) and RoPE scaling off.
    "tiny": LlamaConfig(
        name="tiny", vocab_size=BYTE_VOCAB_SIZE, hidden_size=128, intermediate_size=384,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=BYTE_BOS, eos_token_ids=(BYTE_EOS,), pad_token_id=BYTE_PAD),
    # The performance reference model for CPU benchmarks.
    "small": LlamaConfig(
        name="small", vocab_size=32000, hidden_size=512, intermediate_size=1408,
        num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,)),
    "llama2-7b": LlamaConfig(
        name="llama2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_ids=(2,)),
    "llama3-8b": LlamaConfig(
        name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        bos_token_id=128000, eos_token_ids=(128001,)),
    "llama3.2-1b": LlamaConfig(
        name="llama3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # SmolLM2-135M-Instruct's shapes (9 query / 3 KV heads: tp in {1, 3}). With random
    # weights here; `load_model("smollm2")` fetches the real ones.
    "smollm2-135m": LlamaConfig(
        name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), pad_token_id=2),
}

DEFAULT_PRESET = "tiny"


def get_preset(name: str) -> LlamaConfig:
    """A preset's shapes; a fetchable checkpoint's name gives its shapes too."""
    from jaxdisagg.model.fetch import CATALOG

    if name in CATALOG:
        name = CATALOG[name].shapes
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)} "
            "(or pass a checkpoint directory or .gguf file)") from None
