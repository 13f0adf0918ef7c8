"""Our Llama matches transformers' LlamaForCausalLM on the same (random) weights."""

import numpy as np
import pytest
import torch
from flax import nnx
from hf_util import hf_logits, make_hf_model, random_ids

from jaxdisagg.model import KVLayout, ReferenceGenerator, SamplingParams, jit_serving_fns
from jaxdisagg.model.weights import load_hf_checkpoint

CASES = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa": dict(heads=8, kv_heads=2),
    "llama3-rope-scaling": dict(heads=4, kv_heads=2, rope_scaling=dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)),
    "tied": dict(heads=4, kv_heads=2, tie=True),
}
PROMPT_LENS = (9, 40)  # 40 > 16: past the scaled model's original context
DECODE_STEPS = 5


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path, hf = make_hf_model(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    return load_hf_checkpoint(path), hf


def test_prompt_logits_match(pair):
    ours, hf = pair
    prompts = [random_ids(n, n, ours.config.vocab_size) for n in PROMPT_LENS]
    got = ReferenceGenerator(ours).prompt_logits(prompts)
    for i, ids in enumerate(prompts):
        want = hf_logits(hf, ids)
        np.testing.assert_allclose(got[i, : len(ids)], want, atol=1e-4, rtol=0)
        assert np.abs(want).max() > 1.0  # logits far from flat: a wrong weight would show


def test_greedy_decode_matches(pair):
    """HF generate's greedy tokens, and HF logits at every decode step."""
    ours, hf = pair
    prompts = [random_ids(n + 1, n, ours.config.vocab_size) for n in PROMPT_LENS]
    step_logits = []
    gen = ReferenceGenerator(ours)
    tokens = [[] for _ in prompts]
    for step in gen.stream(prompts, SamplingParams(max_tokens=DECODE_STEPS), stop_token_ids=[],
                           logits_out=step_logits):
        for row, tok in zip(tokens, step, strict=True):
            row.append(tok)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=DECODE_STEPS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert tokens[i] == out[0, len(ids):].tolist()
        want = hf_logits(hf, ids + tokens[i][:-1])[len(ids) - 1:]
        got = np.stack([s[i] for s in step_logits])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_paged_path_matches_hf(pair):
    """End to end: chunked paged prefill and paged decode against HF directly."""
    ours, hf = pair
    graphdef, state = nnx.split(ours)
    fns = jit_serving_fns(graphdef)
    kv = KVLayout.for_model(ours.config, num_blocks=16, block_size=8).allocate()
    table = np.random.default_rng(0).permutation(16)[:8].astype(np.int32)
    ids = random_ids(7, 40, ours.config.vocab_size)
    want = hf_logits(hf, ids)
    chunk = 16
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        padded = np.zeros(chunk, np.int32)
        padded[: len(piece)] = piece
        logits, kv = fns.prefill(state, kv, padded, np.int32(start), np.int32(len(piece)), table)
        np.testing.assert_allclose(logits, want[start + len(piece) - 1], atol=1e-4, rtol=0)
    # Three greedy decode steps, each checked against HF over the extended sequence.
    seq, last = list(ids), np.asarray(logits)
    for _ in range(3):
        pos = len(seq)
        seq.append(int(np.argmax(last)))
        logits, kv = fns.decode(state, kv, np.array(seq[-1:], np.int32),
                                np.array([pos], np.int32), table[None],
                                np.array([pos + 1], np.int32))
        last = np.asarray(logits[0])
        np.testing.assert_allclose(last, hf_logits(hf, seq)[-1], atol=1e-4, rtol=0)
