"""Reference generator: a contiguous (non-paged) KV cache and dense attention.

This is the correctness anchor. It shares the weights and the layer code with the
serving path but none of the cache handling: no pages, no block tables, no
chunking, its own attention. If the paged path and this agree, both are right.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdisagg.model.llama import Llama
from jaxdisagg.model.sampling import SamplingParams, row_keys, sample

_MASKED = jnp.finfo(jnp.float32).min


def dense_attend(positions):
    """attend over a contiguous cache [B, S, K, H]: write at positions [B, T], attend s <= pos."""

    def attend(q, k, v, cache):
        kc, vc = cache
        rows = jnp.arange(q.shape[0])[:, None]
        kc = kc.at[rows, positions].set(k.astype(kc.dtype))
        vc = vc.at[rows, positions].set(v.astype(vc.dtype))
        b, t, n, h = q.shape
        kh = kc.shape[2]
        qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]
        logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, kc,
                            preferred_element_type=jnp.float32) * h ** -0.5
        mask = jnp.arange(kc.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
        probs = jax.nn.softmax(jnp.where(mask[:, None, None], logits, _MASKED), axis=-1)
        out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, vc.astype(jnp.float32))
        return out.reshape(b, t, n, h).astype(q.dtype), (kc, vc)

    return attend


def _forward(graphdef, state, caches, tokens, positions):
    model: Llama = nnx.merge(graphdef, state)
    x, caches = model.run_layers(model.embed(tokens), positions, caches, dense_attend(positions))
    return x, caches


class ReferenceGenerator:
    """Greedy or sampled generation for a batch of prompts (lists of token ids)."""

    def __init__(self, model: Llama):
        self.config = model.config
        self.dtype = model.dtype
        self.graphdef, self.state = nnx.split(model)
        self._prefill = jax.jit(self._prefill_impl)
        self._step = jax.jit(self._step_impl, donate_argnums=(1,))
        self._all_logits = jax.jit(self._all_logits_impl)

    def _all_logits_impl(self, state, caches, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, _ = _forward(self.graphdef, state, caches, tokens, positions)
        return nnx.merge(self.graphdef, state).logits(x)

    def _prefill_impl(self, state, caches, tokens, lengths):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, caches = _forward(self.graphdef, state, caches, tokens, positions)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return nnx.merge(self.graphdef, state).logits(last), caches

    def _step_impl(self, state, caches, tokens, positions):
        x, caches = _forward(self.graphdef, state, caches, tokens[:, None], positions[:, None])
        return nnx.merge(self.graphdef, state).logits(x[:, 0]), caches

    def prompt_logits(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """fp32 logits of every prompt position [B, T, V] (right-padded), for parity tests."""
        tokens, _ = self._pad(prompts)
        caches = self._new_caches(len(prompts), tokens.shape[1])
        return np.asarray(self._all_logits(self.state, caches, tokens))

    def stream(self, prompts: Sequence[Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               stop_token_ids: Sequence[int] | None = None,
               logits_out: list | None = None) -> Iterator[list[int | None]]:
        """Yields, per step, one new token per prompt (None once that row has finished).

        A row finishes after a stop token (default: the model's EOS ids, the token
        itself is emitted) or after its max_tokens. If `logits_out` is a list, the
        fp32 logits [B, V] used at each step are appended to it.
        """
        b = len(prompts)
        params = SamplingParams() if params is None else params
        params = [params] * b if isinstance(params, SamplingParams) else list(params)
        if len(params) != b:
            raise ValueError(f"got {len(params)} SamplingParams for {b} prompts")
        stops = set(self.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
        tokens, lengths = self._pad(prompts)
        max_new = max(p.max_tokens for p in params)
        total = int(lengths.max()) + max_new
        if total > self.config.max_position_embeddings:
            raise ValueError(f"prompt length + max_tokens = {total} exceeds the model's "
                             f"max_position_embeddings ({self.config.max_position_embeddings})")
        caches = self._new_caches(b, total)
        temperature = jnp.array([p.temperature for p in params], jnp.float32)
        top_k = jnp.array([min(p.top_k, self.config.vocab_size) for p in params], jnp.int32)
        top_p = jnp.array([p.top_p for p in params], jnp.float32)
        seeds = [p.seed for p in params]

        logits, caches = self._prefill(self.state, caches, tokens, lengths)
        positions = lengths
        done = np.zeros(b, bool)
        for step in range(max_new):
            if logits_out is not None:
                logits_out.append(np.asarray(logits))
            new = np.asarray(sample(logits, row_keys(seeds, step), temperature, top_k, top_p))
            out: list[int | None] = []
            for i, tok in enumerate(new.tolist()):
                if done[i]:
                    out.append(None)
                    continue
                out.append(tok)
                done[i] = tok in stops or step + 1 >= params[i].max_tokens
            yield out
            if done.all():
                return
            logits, caches = self._step(self.state, caches, jnp.asarray(new, jnp.int32),
                                        positions)
            positions = positions + 1

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 stop_token_ids: Sequence[int] | None = None) -> list[list[int]]:
        """New tokens per prompt (stop token included when one ended the row)."""
        results: list[list[int]] = [[] for _ in prompts]
        for step_tokens in self.stream(prompts, params, stop_token_ids):
            for row, tok in zip(results, step_tokens, strict=True):
                if tok is not None:
                    row.append(tok)
        return results

    def _pad(self, prompts: Sequence[Sequence[int]]) -> tuple[jax.Array, jax.Array]:
        if not prompts:
            raise ValueError("prompts must not be empty")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty")
            bad = [t for t in p if not 0 <= int(t) < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}] has token ids outside the vocabulary "
                                 f"[0, {self.config.vocab_size}): {bad[:5]}")
        lengths = np.array([len(p) for p in prompts], np.int32)
        tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        return jnp.asarray(tokens), jnp.asarray(lengths)

    def _new_caches(self, batch: int, length: int):
        cfg = self.config
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        return [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                for _ in range(cfg.num_layers)]
