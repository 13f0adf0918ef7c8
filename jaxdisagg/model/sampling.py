"""Token sampling on device, one parameter set per row.

temperature 0 means greedy; top_k 0 and top_p 1 disable those filters. Each
row draws from its own key, so a request's tokens depend only on its seed and
its step, never on which other requests share the batch.

`SamplingParams` accepts exactly what the sampler can hold: a seed is any int in
[0, 2^64) (its two 32-bit halves both enter the key), a top_k of any size (the
sampler clamps it to the vocabulary), finite floats. Every front end builds one, so
a value that passes here never fails inside a serving step.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

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
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("temperature", "top_p", "top_k", "seed", "max_tokens"):
            v = getattr(self, name)  # numpy scalars become Python numbers; bools stay bools
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                integral = name in ("top_k", "seed", "max_tokens")
                if not integral:
                    object.__setattr__(self, name, float(v))
                elif isinstance(v, numbers.Integral):
                    object.__setattr__(self, name, int(v))
        checks = [
            ("temperature", _is_real(self.temperature) and self.temperature >= 0,
             "must be a finite number >= 0 (0 is greedy)"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "must be an int >= 0 (0 is off)"),
            ("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens > 0,
             "must be a positive int"),
            ("seed", _is_int(self.seed) and 0 <= self.seed < 2**64, "must be an int in [0, 2^64)"),
            ("logprobs", isinstance(self.logprobs, bool), "must be a bool"),
            ("stop", isinstance(self.stop, tuple)
             and all(isinstance(x, str) and x for x in self.stop), "must be non-empty strings"),
        ]
        for field, ok, why in checks:
            if not ok:
                got = repr(getattr(self, field))
                raise ValueError(f"SamplingParams.{field} {why}, got {got[:80]}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, float) and math.isfinite(v)


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


def _sample_batch(logits, keys, temperature, top_k, top_p, greedy=None):
    """greedy: each row's argmax when the caller has it already."""
    if greedy is None:
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


class RowParams(NamedTuple):
    """Per-row sampling inputs as arrays [B], ready to pass into a jitted program."""

    seed_lo: np.ndarray  # uint32
    seed_hi: np.ndarray  # uint32
    steps: np.ndarray  # uint32: the index of the token each row draws
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray


def row_params(params: list[SamplingParams | None], steps, vocab: int) -> RowParams:
    """Packs B rows' params (None: an empty row, sampled greedily and ignored)."""
    b = len(params)
    temperature, top_p = np.zeros(b, np.float32), np.ones(b, np.float32)
    top_k, seeds = np.zeros(b, np.int32), [0] * b
    for i, p in enumerate(params):
        if p is not None:  # a top_k past the vocabulary keeps everything, as 0 does
            temperature[i], top_k[i], top_p[i] = p.temperature, min(p.top_k, vocab), p.top_p
            seeds[i] = p.seed
    lo, hi = _split_seeds(seeds)
    steps = np.broadcast_to(np.asarray(steps, np.uint32), lo.shape).copy()
    return RowParams(lo, hi, steps, temperature, top_k, top_p)


def sample_with_logprobs(logits, rows: RowParams, argmax_log_norm=None):
    """Traceable: tokens [B] int32 and each chosen token's log-probability under the
    model's (unfiltered, temperature 1) distribution. Serving programs call it inside
    their own jit, so only B ids and B floats leave the device.

    argmax_log_norm: a function logits -> (each row's first argmax [B], its
    log(sum exp(x - x_max)) [B]), e.g. the CPU kernel, in place of `jnp.argmax` and
    `log_softmax` (XLA:CPU's take ~2 ms at 8 x 49152); same tokens, logprobs up to
    rounding."""
    keys = _keys(rows.seed_lo, rows.seed_hi, rows.steps)
    if argmax_log_norm is None:
        tokens = _sample_batch(logits, keys, rows.temperature, rows.top_k, rows.top_p)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    best, log_norm = argmax_log_norm(logits)
    tokens = _sample_batch(logits, keys, rows.temperature, rows.top_k, rows.top_p, best)

    def at(i):
        return jnp.take_along_axis(logits, i[:, None], axis=-1)[:, 0]

    return tokens, (at(tokens) - at(best)) - log_norm


_sample_jit = jax.jit(sample_with_logprobs)


def sample_rows(logits, params: list[SamplingParams | None], steps: list[int]):
    """Samples B rows of logits [B, V] with per-row params (None: an empty row).

    Returns numpy (tokens [B], logprobs [B]). Token `steps[i]` of row i's request
    draws with the key `row_keys` gives (seed, step): the convention every engine shares.
    """
    tokens, logprobs = _sample_jit(logits, row_params(params, steps, logits.shape[-1]))
    return np.asarray(tokens), np.asarray(logprobs)


def _keys(lo, hi, steps):
    def one(lo, hi, i):
        key = jax.random.key(lo)
        # The high half joins the key only when set, so 32-bit seeds keep their streams.
        wide = jax.random.fold_in(key, hi)
        key = jax.random.wrap_key_data(jnp.where(hi > 0, jax.random.key_data(wide),
                                                 jax.random.key_data(key)))
        return jax.random.fold_in(key, i)

    return jax.vmap(one)(lo, hi, steps)


_row_keys = jax.jit(_keys)


def _split_seeds(seeds) -> tuple[np.ndarray, np.ndarray]:
    """ints in [0, 2^64) -> 32-bit halves (JAX runs without 64-bit types)."""
    wide = np.asarray([int(s) for s in seeds], np.uint64)
    lo = (wide & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return lo, (wide >> np.uint64(32)).astype(np.uint32)


def row_keys(seeds, steps):
    """One key per row: fold the index of the token being drawn into the row's own seed.

    `seeds` are ints in [0, 2^64) (split into 32-bit halves on the host: JAX runs
    without 64-bit types). `steps` is one int for every row, or one per row (rows of
    a continuous batch are at different points of their requests). Token i of a
    request always uses the same key, whichever engine or batch draws it.
    """
    seeds = list(seeds) if isinstance(seeds, (list, tuple)) else np.ravel(seeds).tolist()
    lo, hi = _split_seeds(seeds)
    steps = np.broadcast_to(np.asarray(steps, np.uint32), lo.shape)
    return _row_keys(lo, hi, steps)
