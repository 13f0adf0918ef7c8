"""The paged serving entry points agree with the contiguous reference generator."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdisagg.model import KVLayout, ReferenceGenerator, SamplingParams, jit_serving_fns

BLOCK = 8
PROMPT_LENS = (5, 17, 33)  # ragged: none a multiple of the block size except by chance
MAX_PAGES = 8  # per request: 64 positions


def random_prompts(rng, lens, vocab):
    return [rng.integers(0, vocab, size=n).tolist() for n in lens]


def random_tables(rng, n_requests, num_blocks):
    """Disjoint, shuffled (non-contiguous) page lists, one row per request."""
    perm = rng.permutation(num_blocks)[: n_requests * MAX_PAGES]
    return perm.reshape(n_requests, MAX_PAGES).astype(np.int32)


def prefill_in_chunks(fns, state, kv, prompt, table, chunk):
    """Runs the prompt chunk by chunk; returns (logits after each chunk, pages)."""
    out = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        tokens = np.zeros(chunk, np.int32)
        tokens[: len(piece)] = piece
        logits, kv = fns.prefill(state, kv, jnp.asarray(tokens), jnp.int32(start),
                                 jnp.int32(len(piece)), jnp.asarray(table))
        out.append((start + len(piece) - 1, np.asarray(logits)))
    return out, kv


@pytest.fixture(scope="module")
def setup(tiny_model):
    graphdef, state = nnx.split(tiny_model)
    return tiny_model, state, jit_serving_fns(graphdef)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_matches_reference(setup, chunk):
    model, state, fns = setup
    rng = np.random.default_rng(chunk)
    prompts = random_prompts(rng, PROMPT_LENS, model.config.vocab_size)
    ref = ReferenceGenerator(model).prompt_logits(prompts)  # [B, T, V]
    layout = KVLayout.for_model(model.config, num_blocks=32, block_size=BLOCK)
    kv = layout.allocate()
    tables = random_tables(rng, len(prompts), layout.num_blocks)
    for i, prompt in enumerate(prompts):
        results, kv = prefill_in_chunks(fns, state, kv, prompt, tables[i], chunk)
        for pos, logits in results:
            np.testing.assert_allclose(logits, ref[i, pos], atol=1e-5, rtol=0)


def test_prefill_padding_touches_no_other_block(setup):
    model, state, fns = setup
    rng = np.random.default_rng(0)
    layout = KVLayout.for_model(model.config, num_blocks=16, block_size=BLOCK)
    poison = 7.0
    kv = layout.allocate()
    kv = type(kv)(tuple(jnp.full_like(k, poison) for k in kv.k),
                  tuple(jnp.full_like(v, poison) for v in kv.v))
    # 11 real tokens in two pages; the table's unused entries point at real blocks
    # (3, 4) that belong to someone else, and the chunk is padded to 32.
    table = np.array([9, 2, 3, 4, 3, 4, 3, 4], np.int32)
    prompt = rng.integers(0, model.config.vocab_size, size=11).tolist()
    _, kv = prefill_in_chunks(fns, state, kv, prompt, table, chunk=32)
    for pages in (*kv.k, *kv.v):
        pages = np.asarray(pages)
        untouched = [b for b in range(layout.num_blocks) if b not in (9, 2)]
        assert (pages[untouched] == poison).all()
        assert (pages[9] != poison).all(axis=(1, 2)).all()  # 8 positions written
        assert (pages[2, :3] != poison).all() and (pages[2, 3:] == poison).all()


def test_decode_steps_match_reference(setup):
    """Ragged batch with an empty slot in the middle, greedy tokens and logits per step."""
    model, state, fns = setup
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, PROMPT_LENS, model.config.vocab_size)
    steps = 6
    ref_logits = []
    ref_gen = ReferenceGenerator(model)
    ref_tokens = ref_gen.generate(prompts, SamplingParams(max_tokens=steps), stop_token_ids=[])
    list(ref_gen.stream(prompts, SamplingParams(max_tokens=steps), stop_token_ids=[],
                        logits_out=ref_logits))

    layout = KVLayout.for_model(model.config, num_blocks=40, block_size=BLOCK)
    kv = layout.allocate()
    tables = random_tables(rng, len(prompts) + 1, layout.num_blocks)
    slots = [0, 2, 3]  # slot 1 stays empty
    for i, prompt in enumerate(prompts):
        results, kv = prefill_in_chunks(fns, state, kv, prompt, tables[slots[i]], chunk=16)
        np.testing.assert_allclose(results[-1][1], ref_logits[0][i], atol=1e-5, rtol=0)

    n_slots = 4
    lens = np.zeros(n_slots, np.int32)
    tokens = np.zeros(n_slots, np.int32)
    for i, s in enumerate(slots):
        lens[s] = len(prompts[i])
        tokens[s] = ref_tokens[i][0]
    for step in range(1, steps):
        positions = lens.copy()
        seq_lens = np.where(lens > 0, lens + 1, 0).astype(np.int32)
        logits, kv = fns.decode(state, kv, jnp.asarray(tokens), jnp.asarray(positions),
                                jnp.asarray(tables[:n_slots]), jnp.asarray(seq_lens))
        logits = np.asarray(logits)
        for i, s in enumerate(slots):
            np.testing.assert_allclose(logits[s], ref_logits[step][i], atol=1e-5, rtol=0)
            assert int(logits[s].argmax()) == ref_tokens[i][step]
            tokens[s] = ref_tokens[i][step]
        assert np.isfinite(logits).all()
        lens = np.where(lens > 0, lens + 1, 0).astype(np.int32)


def test_empty_decode_slot_writes_nothing(setup):
    model, state, fns = setup
    layout = KVLayout.for_model(model.config, num_blocks=8, block_size=BLOCK)
    kv = layout.allocate()
    before = [np.asarray(k).copy() for k in kv.k]
    tables = np.arange(16, dtype=np.int32).reshape(2, 8) % 8
    logits, kv = fns.decode(state, kv, jnp.array([5, 6], jnp.int32), jnp.array([3, 0], jnp.int32),
                            jnp.asarray(tables), jnp.array([0, 0], jnp.int32))
    assert np.isfinite(np.asarray(logits)).all()
    for b, k in zip(before, kv.k, strict=True):
        np.testing.assert_array_equal(b, np.asarray(k))


def _compiled_step(setup, kind: str, width: int) -> str:
    """The optimised HLO of a decode step of `width` slots or a prefill chunk of `width`
    tokens, over a 37-block pool."""
    model, state, fns = setup
    kv = KVLayout.for_model(model.config, num_blocks=37, block_size=BLOCK).allocate()
    i32 = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    if kind == "decode":
        lowered = fns.decode.lower(state, kv, i32(width), i32(width), i32(width, MAX_PAGES),
                                   i32(width))
    else:
        lowered = fns.prefill.lower(state, kv, i32(width), jnp.int32(0), jnp.int32(1),
                                    i32(MAX_PAGES))
    return lowered.compile().as_text()


@pytest.mark.parametrize("kind,width", [("decode", 1), ("decode", 3), ("prefill", 1),
                                        ("prefill", 16)])
def test_steps_update_the_pool_in_place(setup, kind, width):
    """The compiled step never copies a KV pool: its cost must not grow with the pool.

    (A one-row scatter used to become a dynamic-update-slice that XLA:CPU could not
    do in place, copying every layer's pool on every step.)
    """
    hlo = _compiled_step(setup, kind, width)
    pool = rf"f32\[(37,{BLOCK}|{37 * BLOCK}),"
    copies = [line for line in hlo.splitlines() if re.search(pool + r".* copy\(", line)]
    assert not copies, "\n".join(copies[:4])


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_steps_compute_the_rope_angles_once(setup, kind):
    """The cos and sin of the positions are computed once a call, not once a layer.

    (XLA:CPU fused them into every layer's rope and evaluated them per element of q
    and k: 1 ms of an 8-slot SmolLM2 decode step.)
    """
    hlo = _compiled_step(setup, kind, 4 if kind == "decode" else 16)
    assert setup[0].config.num_layers > 1
    assert len(re.findall(r" cosine\(", hlo)) == 1
    assert len(re.findall(r" sine\(", hlo)) == 1


def test_positions_past_the_table_are_dropped_not_clipped(setup):
    """A table too short for the chunk (a caller bug) must not corrupt its last page."""
    model, state, fns = setup
    layout = KVLayout.for_model(model.config, num_blocks=8, block_size=BLOCK)
    kv = layout.allocate()
    table = np.array([5, 6], np.int32)  # room for 16 positions, the chunk has 20
    prompt = np.random.default_rng(3).integers(0, model.config.vocab_size, 20).tolist()
    short_kv = KVLayout.for_model(model.config, num_blocks=8, block_size=BLOCK).allocate()
    _, short_kv = prefill_in_chunks(fns, state, short_kv, prompt[:16], table, chunk=32)
    _, kv = prefill_in_chunks(fns, state, kv, prompt, table, chunk=32)
    for got, want in zip((*kv.k, *kv.v), (*short_kv.k, *short_kv.v), strict=True):
        # Pages 5 and 6 hold exactly positions 0-15, as if the 4 extra never came.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
