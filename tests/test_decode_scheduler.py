"""Continuous batching on a pool: same tokens as the reference, preemption, cancel,
sampling seeds; every scenario ends with all blocks back and the invariants held."""

import jax.numpy as jnp
import numpy as np
import pytest
from kv_util import make_pool

from jaxdisagg.mesh.deployment import prefill_request
from jaxdisagg.model import ReferenceGenerator, SamplingParams
from jaxdisagg.model.sampling import row_keys, sample
from jaxdisagg.serve.decode import DecodeScheduler, Sequence
from jaxdisagg.serve.kv_cache import BlockManager

BS = 8


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def overlap(request):
    """Every scenario runs both ways: each step read before the next is dispatched, and
    the next dispatched first (fed the previous tokens on the device)."""
    return request.param


@pytest.fixture(scope="module")
def inst(tiny_model):
    return make_pool(tiny_model, [0, 1], 2)  # 24 blocks of 8, 3 slots, 8 pages a request


def prompts(seed, lens):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lens]


def prefilled(inst, mgr, rid, prompt, params, generated=()):
    """Prefills prompt (+ tokens already generated, when resuming) and returns a Sequence."""
    ids = list(prompt) + list(generated)[:-1]
    blocks = mgr.allocate(-(-len(ids) // BS))
    logits, _, _ = prefill_request(inst, ids, blocks)
    seq = Sequence(rid, list(prompt), params, frozenset(), blocks=blocks, tokens=list(generated))
    if not generated:
        p = params
        first = sample(logits[None], row_keys([p.seed], 0), jnp.array([p.temperature]),
                       jnp.array([p.top_k]), jnp.array([p.top_p]))
        seq.tokens = [int(first[0])]
    return seq


def run(sched, pending, arrivals=None, max_steps=200):
    """Admits pending sequences as slots allow (and as they arrive), steps to the end."""
    done, step, waiting = {}, 0, list(pending)
    while (waiting or sched.active or sched.in_flight) and step < max_steps:
        for seq in list(waiting):
            if sched.free_slots() and (arrivals is None or arrivals[seq.request_id] <= step):
                waiting.remove(seq)
                if seq.finish_check():  # finished on its first token
                    sched.blocks.release(seq.blocks)
                    done[seq.request_id] = seq
                else:
                    sched.admit(seq)
        result = sched.step()
        for seq in result.finished:
            done[seq.request_id] = seq
        waiting += result.preempted
        step += 1
    return done, waiting


def test_mixed_lengths_arriving_at_different_times(tiny_model, inst, overlap):
    mgr = BlockManager(inst.layout.num_blocks, BS, prefix_cache=False)
    sched = DecodeScheduler(inst, mgr, overlap=overlap)
    ps = prompts(0, (5, 17, 30, 11))
    limits = (6, 9, 4, 7)
    params = [SamplingParams(max_tokens=n) for n in limits]
    seqs = [prefilled(inst, mgr, f"r{i}", p, params[i]) for i, p in enumerate(ps)]
    done, _ = run(sched, seqs, arrivals={"r0": 0, "r1": 0, "r2": 2, "r3": 5})
    want = ReferenceGenerator(tiny_model).generate(ps, params, stop_token_ids=[])
    assert [done[f"r{i}"].tokens for i in range(4)] == want
    assert all(done[f"r{i}"].finish_reason == "length" for i in range(4))
    mgr.check()
    assert mgr.num_available == mgr.num_blocks


def test_kv_exhaustion_preempts_and_outputs_stay_identical(tiny_model, inst, overlap):
    mgr = BlockManager(9, BS, prefix_cache=False)  # 9 blocks for 3 requests growing to 3-4
    sched = DecodeScheduler(inst, mgr, overlap=overlap)
    ps = prompts(1, (14, 15, 13))
    params = SamplingParams(max_tokens=12)
    want = ReferenceGenerator(tiny_model).generate(ps, params, stop_token_ids=[])
    waiting = [prefilled(inst, mgr, f"r{i}", p, params) for i, p in enumerate(ps)]
    done, preempted_total = {}, 0
    for _ in range(100):
        for seq in list(waiting):
            need = -(-(seq.last_position + 1) // BS) - 1  # blocks for the tokens so far
            if not seq.blocks and sched.free_slots() and mgr.num_available >= need + 1:
                waiting.remove(seq)
                seq = prefilled(inst, mgr, seq.request_id, seq.prompt, params, seq.tokens)
                sched.admit(seq)
            elif seq.blocks and sched.free_slots():
                waiting.remove(seq)
                sched.admit(seq)
        result = sched.step()
        done.update({s.request_id: s for s in result.finished})
        preempted_total += len(result.preempted)
        waiting += result.preempted
        mgr.check()
        if len(done) == 3:
            break
    assert preempted_total > 0, "the scenario must actually run out of blocks"
    assert [done[f"r{i}"].tokens for i in range(3)] == want
    assert mgr.num_available == mgr.num_blocks


def test_seeded_sampling_matches_reference_and_top_k_1_is_greedy(tiny_model, inst, overlap):
    mgr = BlockManager(inst.layout.num_blocks, BS, prefix_cache=False)
    sched = DecodeScheduler(inst, mgr, overlap=overlap)
    ps = prompts(2, (9, 20))
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7, max_tokens=8),
              SamplingParams(temperature=1.3, top_k=1, seed=3, max_tokens=8)]
    done, _ = run(sched, [prefilled(inst, mgr, f"r{i}", p, params[i])
                          for i, p in enumerate(ps)])
    ref = ReferenceGenerator(tiny_model)
    want = ref.generate(ps, params, stop_token_ids=[])
    assert [done["r0"].tokens, done["r1"].tokens] == want
    assert done["r1"].tokens == ref.generate(ps[1:], SamplingParams(max_tokens=8),
                                             stop_token_ids=[])[0]
    assert mgr.num_available == mgr.num_blocks


def test_stop_token_and_cancel_free_blocks(tiny_model, inst, overlap):
    mgr = BlockManager(inst.layout.num_blocks, BS, prefix_cache=False)
    sched = DecodeScheduler(inst, mgr, overlap=overlap)
    ps = prompts(3, (10, 12))
    free_run = ReferenceGenerator(tiny_model).generate(ps[:1], SamplingParams(max_tokens=6),
                                                       stop_token_ids=[])[0]
    stop = free_run[3]
    a = prefilled(inst, mgr, "a", ps[0], SamplingParams(max_tokens=6))
    a.stop_ids = frozenset({stop})
    b = prefilled(inst, mgr, "b", ps[1], SamplingParams(max_tokens=50))
    sched.admit(a)
    sched.admit(b)
    for _ in range(2):
        sched.step()
    cancelled = sched.cancel("b")
    assert cancelled is b and not b.blocks and sched.cancel("b") is None
    while sched.active or sched.in_flight:
        sched.step()
    assert a.finish_reason == "stop" and a.tokens == free_run[:free_run.index(stop) + 1]
    mgr.check()
    assert mgr.num_available == mgr.num_blocks


def test_attention_reads_the_narrowest_table_that_holds_the_batch(tiny_model, inst, overlap,
                                                                   monkeypatch):
    """Decode runs the narrowest compiled block-table width that holds the longest
    sequence in the batch (not max_pages), and the tokens do not depend on it."""
    assert inst.table_widths == [1, 2, 4, 8]
    widths, real = [], inst._decode

    def spy(state, kv, previous, tokens, carried, positions, tables, lens, rows, index):
        if len(index) == len(lens):  # a smaller batch runs the full width
            widths.append((tables.shape[1], int(lens.max())))
        else:
            assert tables.shape[1] == inst.max_pages
        return real(state, kv, previous, tokens, carried, positions, tables, lens, rows, index)

    monkeypatch.setattr(inst, "_decode", spy)
    mgr = BlockManager(inst.layout.num_blocks, BS, prefix_cache=False)
    sched = DecodeScheduler(inst, mgr, overlap=overlap)
    ps = prompts(3, (3, 12))
    params = SamplingParams(max_tokens=30)
    done, _ = run(sched, [prefilled(inst, mgr, f"r{i}", p, params) for i, p in enumerate(ps)])
    assert [done["r0"].tokens, done["r1"].tokens] == ReferenceGenerator(tiny_model).generate(
        ps, params, stop_token_ids=[])
    for width, longest in widths:
        pages = -(-longest // BS)
        assert width >= pages and (width == 1 or width // 2 < pages)
    assert {w for w, _ in widths} == {2, 4, 8}  # 13 .. 41 tokens of 8 per page


def test_a_step_runs_only_the_busy_slots(tiny_model, inst, overlap, monkeypatch):
    """A step runs the busy slots padded to the smallest compiled batch size, not every
    slot: as requests finish, the steps shrink to one row, and every request's tokens
    (greedy and seeded sampling) are the ones it gets alone."""
    assert inst.batch_sizes == [1, 3]
    steps, real = [], inst._decode

    def spy(state, kv, previous, tokens, carried, positions, tables, lens, rows, index):
        steps.append((len(index), int((lens > 0).sum()), set(np.asarray(index).tolist())))
        return real(state, kv, previous, tokens, carried, positions, tables, lens, rows, index)

    monkeypatch.setattr(inst, "_decode", spy)
    mgr = BlockManager(inst.layout.num_blocks, BS, prefix_cache=False)
    sched = DecodeScheduler(inst, mgr, overlap=overlap)
    ps = prompts(5, (4, 9, 6))
    params = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=12),
              SamplingParams(max_tokens=7, temperature=0.8, seed=11)]
    done, _ = run(sched, [prefilled(inst, mgr, f"r{i}", p, params[i])
                          for i, p in enumerate(ps)])
    ref = ReferenceGenerator(tiny_model)
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        assert done[f"r{i}"].tokens == ref.generate([p], sp, stop_token_ids=[])[0]
    assert {n for n, _, _ in steps} == {1, 3}
    for n, busy, rows in steps:
        assert n == (1 if busy <= 1 else 3) and len(rows) == n  # distinct slots
    mgr.check()
    assert mgr.num_available == mgr.num_blocks


def test_overlap_dispatches_the_next_step_before_reading_this_one(tiny_model, inst,
                                                                 monkeypatch):
    """With overlap, step() returns the previous step's tokens: the first call reads
    nothing, each later one takes the step in flight's tokens on the device. A stop
    token found in flight drops the one row computed past it; its blocks come back."""
    feeds, real = [], inst.decode

    def spy(tokens, *args, previous=None, carried=None):
        feeds.append("host" if previous is None else
                     ("device" if carried.any() else "neither"))
        return real(tokens, *args, previous=previous, carried=carried)

    monkeypatch.setattr(inst, "decode", spy)
    mgr = BlockManager(inst.layout.num_blocks, BS, prefix_cache=False)
    sched = DecodeScheduler(inst, mgr, overlap=True)
    ps = prompts(9, (7, 13))  # a's tokens: 374 374 245 ...
    params = SamplingParams(max_tokens=6)
    want = ReferenceGenerator(tiny_model).generate(ps, params, stop_token_ids=[])
    a = prefilled(inst, mgr, "a", ps[0], params)
    k = next(k for k in range(2, 5) if want[0][k] not in want[0][:k])
    a.stop_ids = frozenset({want[0][k]})  # stops at its token k, decoded in flight
    b = prefilled(inst, mgr, "b", ps[1], params)
    sched.admit(a)
    sched.admit(b)
    first = sched.step()
    assert first.launched and not first.tokens and sched.in_flight
    programs = inst._decode._cache_size()
    second = sched.step()
    assert [rid for rid, *_ in second.tokens] == ["a", "b"]
    # the step fed on the device is the program the host-fed one compiled
    assert inst._decode._cache_size() == programs
    while sched.active or sched.in_flight:
        sched.step()
    assert a.finish_reason == "stop" and a.tokens == want[0][:k + 1]
    assert b.finish_reason == "length" and b.tokens == want[1]
    assert feeds[0] == "host" and set(feeds[1:]) == {"device"}
    # b's 5 decoded tokens take 5 steps; the last is dispatched with nothing after it
    assert len(feeds) == 5
    mgr.check()
    assert mgr.num_available == mgr.num_blocks


def test_a_finished_sequence_is_refused_admission(tiny_model, inst):
    mgr = BlockManager(inst.layout.num_blocks, BS, prefix_cache=False)
    sched = DecodeScheduler(inst, mgr, overlap=True)
    seq = prefilled(inst, mgr, "done", prompts(5, (6,))[0], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already finished"):
        sched.admit(seq)
    mgr.release(seq.blocks)
    assert mgr.num_available == mgr.num_blocks
