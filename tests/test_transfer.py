"""KV moves between disjoint sub-meshes bit for bit, asynchronously, without compiling."""

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv_util import decode_greedy, make_pool, original_heads

from jaxdisagg.mesh import Deployment, finish_transfer, prefill_request
from jaxdisagg.mesh.config import RouterConfig
from jaxdisagg.mesh.transfer import (
    InFlightKV,
    InProcessTransfer,
    KVSink,
    KVSource,
    all_buckets,
    page_runs,
)
from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.serve.engine import DisaggregatedEngine

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROMPT = list(np.random.default_rng(0).integers(0, 256, 45))  # 3 chunks of 16, 6 pages of 8


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("src_tp,dst_tp", [(4, 4), (4, 2), (2, 4), (1, 4)])
def test_kv_arrives_bit_for_bit(tiny_model, src_tp, dst_tp, streaming):
    src = make_pool(tiny_model, list(range(src_tp)), src_tp)
    dst = make_pool(tiny_model, list(range(4, 4 + dst_tp)), dst_tp)
    xfer = InProcessTransfer(src, dst)
    src_blocks, dst_blocks = [7, 2, 19, 4, 11, 0], [3, 22, 5, 14, 8, 1]
    logits, parts, first = prefill_request(src, PROMPT, src_blocks, xfer, streaming)
    # 6 pages move as runs of 4 + 2 (per layer group when streamed): no padding on the wire
    assert len(parts) == 2 * (len(src.groups) if streaming else 1)
    assert all(p.pages.shape[2] == p.num_pages for p in parts)
    stats = finish_transfer(xfer, logits, parts, dst_blocks, first)
    for layer in range(tiny_model.config.num_layers):
        for s, d in ((src.kv.k[layer], dst.kv.k[layer]), (src.kv.v[layer], dst.kv.v[layer])):
            want = original_heads(src, s)[src_blocks]
            assert np.array_equal(original_heads(dst, d)[dst_blocks], want)
            # Replicated copies on the decode side hold the same bits as their original.
            got = np.asarray(d)[dst_blocks]
            r = dst.kv_replication
            assert np.array_equal(got, np.repeat(got[:, :, ::r], r, axis=2))
            untouched = [b for b in range(24) if b not in dst_blocks]
            assert not np.asarray(d)[untouched].any()
    cfg = tiny_model.config
    assert stats.bytes_moved == 2 * cfg.num_layers * 6 * 8 * cfg.num_kv_heads * cfg.head_dim * 4
    assert stats.transfer_s >= stats.exposed_s >= 0


@pytest.mark.parametrize("name", ["cpu-1p1d.yaml", "cpu-hetero.yaml"])
def test_request_prefilled_on_one_pool_decodes_on_the_other(deployments, name):
    dep = deployments(name)
    prefill, decode = dep.pools["prefill"][0], dep.pools["decode"][0]
    assert not set(prefill.devices) & set(decode.devices)
    steps = 8
    want = ReferenceGenerator(dep.model).generate([PROMPT], SamplingParams(max_tokens=steps),
                                                  stop_token_ids=[])[0]
    blocks = [3, 1, 2, 0]  # 45 tokens + 8 new fit in 4 pages of 16
    logits, parts, first = prefill_request(prefill, PROMPT, blocks, dep.transfers[(0, 0)],
                                           dep.config.transfer.layer_streaming)
    finish_transfer(dep.transfers[(0, 0)], logits, parts, [9, 4, 7, 5], first)
    got = decode_greedy(decode, int(np.argmax(np.asarray(logits))), len(PROMPT), [9, 4, 7, 5],
                        steps)
    assert got == want


def test_colocated_pool_prefills_and_decodes(deployments):
    dep = deployments("cpu-colocated.yaml")
    assert len(dep.pools["colocated"]) == 2 and not dep.transfers
    inst = dep.pools["colocated"][1]
    want = ReferenceGenerator(dep.model).generate([PROMPT], SamplingParams(max_tokens=6),
                                                  stop_token_ids=[])[0]
    logits, _, _ = prefill_request(inst, PROMPT, [5, 6, 7, 8])
    assert decode_greedy(inst, int(np.argmax(np.asarray(logits))), len(PROMPT), [5, 6, 7, 8],
                         6) == want


@contextlib.contextmanager
def compilations():
    """Collects the programs compiled inside the block."""
    compiles = []

    def listen(event, duration, **kwargs):
        # Lowering too: a program found in the persistent compilation cache (the
        # suite turns it on) skips the backend compile but is still lowered first.
        if event in ("/jax/core/compile/backend_compile_duration",
                     "/jax/core/compile/jaxpr_to_mlir_module_duration"):
            compiles.append((event, kwargs.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_no_compilation_after_warmup():
    dep = Deployment.build(str(CONFIGS / "cpu-hetero.yaml"))  # fresh: nothing served yet
    with compilations() as compiles:
        xfer = dep.transfers[(0, 0)]
        prefill, decode = dep.pools["prefill"][0], dep.pools["decode"][0]
        requests = ((PROMPT, [1, 2, 3]), (PROMPT[:5], [4]), (PROMPT * 3, list(range(5, 14))))
        for prompt, blocks in requests:
            logits, parts, first = prefill_request(prefill, prompt, blocks, xfer)
            finish_transfer(xfer, logits, parts, blocks, first)
            decode_greedy(decode, int(np.argmax(np.asarray(logits))), len(prompt), blocks, 3)
        # ... and through the engine: sampling, local prefill on the decode pool, streaming.
        engine = DisaggregatedEngine(dep, router=RouterConfig(local_prefill_threshold=8))
        with engine:
            engine.generate([PROMPT, PROMPT[:5], PROMPT * 3],
                            [SamplingParams(max_tokens=4, logprobs=True),
                             SamplingParams(max_tokens=3, temperature=0.7, top_k=5, seed=1),
                             SamplingParams(max_tokens=5, top_p=0.9, temperature=1.0)])
    assert compiles == []


def test_each_side_warmed_alone_compiles_nothing_later(tiny_model):
    """The cross-process pools warm their halves separately (no Deployment holds both):
    after KVSource.warmup and KVSink.warmup, moving any number of pages compiles
    nothing, and the sink's warm-up wrote nothing into the pool."""
    src, dst = make_pool(tiny_model, [0, 1], 2), make_pool(tiny_model, [2, 3], 2)
    source, sink = KVSource(src), KVSink(dst)
    before = [np.asarray(p).copy() for p in dst.kv.k]
    source.warmup()
    sink.warmup()
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, dst.kv.k, strict=True))
    with compilations() as compiles:
        for n in (1, 3, 5, src.max_pages):
            blocks = list(range(n))
            for layers in (range(0, 2), range(src.config.num_layers)):
                parts = []
                for offset, count in page_runs(n, src.max_pages):
                    staged, nbytes = source.stage(layers, blocks[offset:offset + count])
                    parts.append(InFlightKV(layers, sink.assemble(source.pieces(staged)),
                                            count, nbytes, offset=offset))
                sink.insert(parts, blocks)
        jax.block_until_ready(dst.kv)
    assert compiles == []


def test_extract_does_not_wait_for_the_producer(tiny_model):
    """The copy is dispatched behind a slow producer instead of stalling on it.

    A synchronous (host) fallback would only return once the producer finished;
    here the producer is still running when `extract` returns.
    """
    src = make_pool(tiny_model, [0, 1, 2, 3], 4)
    dst = make_pool(tiny_model, [4, 5], 2)
    xfer = InProcessTransfer(src, dst)
    xfer.extract(range(0, 2), [1, 2])  # compile outside the timed window

    @jax.jit
    def slow(pages):
        def body(_, m):
            return jnp.tanh(m @ m)
        m = jax.lax.fori_loop(0, 300, body, jnp.full((384, 384), 1e-3, jnp.float32))
        return jax.tree_util.tree_map(lambda p: p + 0 * m[0, 0], pages)

    src.kv = slow(src.kv)
    parts = xfer.extract(range(0, 2), [1, 2])
    assert not src.kv.k[0].is_ready(), "extract blocked on the producer: synchronous copy"
    xfer.insert(parts, [3, 4])
    jax.block_until_ready(dst.kv)
    assert np.array_equal(original_heads(dst, dst.kv.k[0])[[3, 4]],
                          original_heads(src, src.kv.k[0])[[1, 2]])


@pytest.mark.parametrize("max_pages", [8, 21, 64])
def test_page_runs_cover_every_length_exactly(max_pages):
    """Runs of compiled bucket sizes that add up to the request: bytes on the wire are
    the real bytes for every prompt length, with no program beyond the buckets."""
    buckets = all_buckets(max_pages)
    for n in range(1, max_pages + 1):
        runs = page_runs(n, max_pages)
        assert [o for o, _ in runs] == [sum(c for _, c in runs[:i]) for i in range(len(runs))]
        assert sum(c for _, c in runs) == n and all(c in buckets for _, c in runs)
        assert len(runs) <= len(buckets)
    with pytest.raises(ValueError, match="1..8 pages"):
        page_runs(9, 8)


def test_insert_refuses_parts_that_do_not_cover_the_blocks(tiny_model):
    src = make_pool(tiny_model, [0, 1], 2)
    dst = make_pool(tiny_model, [2, 3], 2)
    xfer = InProcessTransfer(src, dst)
    parts = xfer.extract(range(0, 2), [1, 2, 3])  # runs of 2 + 1
    with pytest.raises(ValueError, match=r"layers 0..2: pages \[\(0, 2\)\] .* for 3"):
        xfer.insert(parts[:1], [4, 5, 6])
    with pytest.raises(ValueError, match="for 4 destination blocks"):
        xfer.insert(parts, [4, 5, 6, 7])
    xfer.insert(parts, [4, 5, 6])
