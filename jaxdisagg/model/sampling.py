"""Token sampling on device, one parameter set per row.

temperature 0 means greedy; top_k 0 and top_p 1 disable those filters. Each
row draws from its own key, so a request's tokens depend only on its seed and
its step, never on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    logprobs: bool = False  # return each generated token's log-probability
    stop: tuple[str, ...] = ()  # stop strings (the engine matches them on decoded text)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0 (0 is greedy)"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0,
             "must be an int >= 0 (0 is off)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens > 0,
             "must be a positive int"),
            ("seed", isinstance(self.seed, int), "must be an int"),
            ("stop", all(isinstance(x, str) and x for x in self.stop),
             "must be non-empty strings"),
        ]
        for field, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")


def _sample_row(logits, key, temperature, top_k, top_p):
    """logits [V] fp32 -> token id (int32)."""
    greedy = jnp.argmax(logits).astype(jnp.int32)
    order = jnp.argsort(-logits)
    sorted_logits = logits[order] / jnp.maximum(temperature, 1e-6)
    rank = jnp.arange(logits.shape[0])
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    # Nucleus: keep the smallest prefix whose mass reaches top_p (the top token always).
    keep &= (jnp.cumsum(probs) - probs) < top_p
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
    sampled = order[choice].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def _sample_batch(logits, keys, temperature, top_k, top_p):
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        return jax.vmap(_sample_row)(logits, keys, temperature, top_k, top_p)

    # The sampled path sorts the whole vocabulary per row (300 ms for 32 rows of 32k on
    # two CPU cores); an all-greedy batch, the common case in serving, skips it.
    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)


@jax.jit
def sample(logits, keys, temperature, top_k, top_p):
    """logits [B, V]; keys [B] typed PRNG keys; per-row params [B] -> tokens [B] int32."""
    return _sample_batch(logits, keys, temperature, top_k, top_p)


@jax.jit
def sample_logprobs(logits, keys, temperature, top_k, top_p):
    """Like `sample`, plus each chosen token's log-probability under the model's
    (unfiltered, temperature 1) distribution: tokens [B] int32, logprobs [B] fp32."""
    tokens = _sample_batch(logits, keys, temperature, top_k, top_p)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def sample_rows(logits, params: list[SamplingParams | None], steps: list[int]):
    """Samples B rows of logits [B, V] with per-row params (None: an empty row).

    Returns numpy (tokens [B], logprobs [B]). Token `steps[i]` of row i's request
    draws with fold_in(key(seed), steps[i]), the convention every engine shares.
    """
    b = len(params)
    temperature, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
    top_k, seeds = np.zeros(b, np.int32), np.zeros(b, np.int32)
    for i, p in enumerate(params):
        if p is not None:
            temperature[i], top_k[i], top_p[i], seeds[i] = (p.temperature, p.top_k, p.top_p,
                                                            p.seed)
    tokens, logprobs = sample_logprobs(logits, row_keys(seeds, np.asarray(steps, np.int32)),
                                       temperature, top_k, top_p)
    return np.asarray(tokens), np.asarray(logprobs)


@jax.jit
def _row_keys(seeds, steps):
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)


def row_keys(seeds, steps):
    """One key per row: fold the index of the token being drawn into the row's own seed.

    `steps` is one int for every row, or one per row (rows of a continuous batch are
    at different points of their requests). Token i of a request always uses
    fold_in(key(seed), i), whichever engine or batch draws it.
    """
    seeds = jnp.asarray(seeds, jnp.uint32)
    steps = jnp.broadcast_to(jnp.asarray(steps, jnp.uint32), seeds.shape)
    return _row_keys(seeds, steps)
