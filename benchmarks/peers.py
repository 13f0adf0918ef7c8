"""The same real model through jaxdisagg, HF transformers and llama.cpp, side by side.

    pip install -e '.[peers]'    # llama-cpp-python (built from source), torch, transformers
    python benchmarks/peers.py [--rounds 3] [--out benchmarks/results/peers.json]

SmolLM2-135M-Instruct (`jaxdisagg fetch smollm2`), fp32 for everyone: our loader
dequantizes the GGUF to fp32, transformers loads the same GGUF the same way, and
llama.cpp gets an F32 GGUF written from exactly those tensors. llama.cpp runs twice:
in its default settings and all-fp32 (KV cache f32, flash attention off: its CPU
flash attention rounds K/V to f16).

Correctness first: last-token logits of a chat prompt against ours, and 32 greedy
tokens. Then, alternating the systems in every round (the order rotates):

* prefill of 512 tokens;
* decode B=1 at 512 tokens of context (one step; ours: the served program, sampled on
  the device, tokens copied to the host, one busy slot of 8); B=8 for ours and transformers
  (llama-cpp-python decodes one sequence per context);
* serving: 16 prompts of 256 tokens (new ones each round, the same for every system
  within it), 64 new tokens each, all submitted at once to
  both our engines (one CPU device each for prefill and decode, or one colocated
  instance; the disaggregated one also with its decode batching window, and each
  with the inter-token gaps, TBT, its streams saw); llama.cpp answers them one after
  another, the way one llama-cpp-python context serves, and batched, as llama-server's
  parallel slots do.
  With `--launch`, also the disaggregated deployment as `jaxdisagg launch` runs it
  (two processes, each pinned to one core; the in-process engine's pools share both).

Prints medians and [ranges] over rounds of times and of the ratios ours / peer
(below 1: ours is faster), and writes JSON. This machine is noisy: read ratios
within a round, and a ratio whose range straddles 1.0 as no difference.
"""

import os

# Exactly the host devices it uses: XLA:CPU sizes its thread pool to max(cores, devices).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from common import median_seconds, spread, write_result  # noqa: E402

from jaxdisagg.mesh.config import DeploymentConfig, ModelSpec, PoolConfig, TransferConfig  # noqa: E402,E501
from jaxdisagg.mesh.pool import PoolInstance  # noqa: E402
from jaxdisagg.model import ReferenceGenerator, SamplingParams  # noqa: E402
from jaxdisagg.model.fetch import fetch  # noqa: E402
from jaxdisagg.model.gguf import write_f32_gguf  # noqa: E402
from jaxdisagg.model.sampling import row_params  # noqa: E402
from jaxdisagg.model.weights import load_model  # noqa: E402
from jaxdisagg.serve.engine import Engine  # noqa: E402

CONTEXT, BS, NEW_CHECK = 512, 16, 32
SERVE_REQUESTS, SERVE_PROMPT, SERVE_NEW = 16, 256, 64
THREADS = os.cpu_count()


# ------------------------------------------------------------------------ ours

class Ours:
    """The programs serving runs: one pool instance on device 0 (tp=1, 8 slots, a
    512-token prefill chunk), its parameters passed as the flat tuple the engine
    passes. A decode step runs the busy slots only (padded to a compiled batch size),
    samples on the device, and its tokens are copied to the host, as the decode
    worker reads them."""

    name = "jaxdisagg"

    def __init__(self, model):
        self.model = model
        pages = CONTEXT // BS + 1
        pool = PoolConfig(devices=[0], tp=1, block_size=BS, num_blocks=8 * pages + 1,
                          chunk_size=CONTEXT, max_slots=8, max_pages_per_request=pages)
        self.inst = PoolInstance("ours", model, [0], pool, backend="auto")
        self.tables = np.arange(8 * pages, dtype=np.int32).reshape(8, pages)
        rng = np.random.default_rng(0)
        self.prompt = rng.integers(0, model.config.vocab_size, CONTEXT).astype(np.int32)
        for slot in range(8):  # every slot holds a real 512-token context
            self._prefill(slot)

    def _prefill(self, slot=0):
        self.inst.prefill(self.prompt, 0, CONTEXT, self.tables[slot]).block_until_ready()

    def prefill_s(self, repeats):
        return median_seconds(self._prefill, repeats)

    def decode_s(self, b, repeats):
        slots = self.inst.pool.max_slots
        busy = np.arange(slots) < b
        tokens = np.ones(slots, np.int32)
        pos = np.where(busy, CONTEXT, 0).astype(np.int32)
        lens = np.where(busy, CONTEXT + 1, 0).astype(np.int32)
        rows = row_params([SamplingParams() if x else None for x in busy], 1,
                          self.model.config.vocab_size)

        def step():
            new, logprobs = self.inst.decode(tokens, pos, self.tables, lens, rows)
            np.asarray(new), np.asarray(logprobs)

        return median_seconds(step, repeats)


def serving_configs() -> dict[str, DeploymentConfig]:
    pages = -(-(SERVE_PROMPT + SERVE_NEW) // BS) + 1
    pool = PoolConfig(tp=1, block_size=BS, num_blocks=SERVE_REQUESTS * pages + 16,
                      chunk_size=256, max_pages_per_request=pages,
                      max_slots=SERVE_REQUESTS)
    model = ModelSpec("smollm2", "float32")
    disagg = DeploymentConfig(
        mode="disaggregated", model=model,
        prefill=dataclasses.replace(pool, devices=[0], max_slots=1),
        decode=dataclasses.replace(pool, devices=[1]),
        transfer=TransferConfig(layer_streaming=True, layer_group_size=6))
    return {
        "disaggregated": disagg,
        # The same with the decode batching window: while fewer rows are busy than all
        # the requests routed to it, decode holds a step up to 0.2 s, so the two pools do
        # not both want the two cores while the prompts are prefilled. 0.2 s bought as
        # much throughput as 0.5 s at half the TBT p99 (benchmarks/decode_window.py).
        "disaggregated, window": dataclasses.replace(disagg, decode=dataclasses.replace(
            disagg.decode, decode_min_batch=SERVE_REQUESTS, decode_wait_s=0.2)),
        "colocated": DeploymentConfig(mode="colocated", model=model,
                                      colocated=dataclasses.replace(pool, devices=[0])),
    }


class Launched:
    """The disaggregated deployment as `jaxdisagg launch` runs it: prefill and decode in
    two processes, each pinned to its own core, the KV pulled across them. The
    in-process engine's pools share the process's two cores; this is the placement
    disaggregation assumes (each phase on hardware of its own). Same pool sizes."""

    def __init__(self):
        import disagg_vs_colocated as dv  # starts and stops servers the same way

        from jaxdisagg.serve.client import Client

        cfg = serving_configs()["disaggregated"]
        keys = ("tp", "block_size", "num_blocks", "chunk_size", "max_pages_per_request",
                "max_slots")
        pools = {role: {"devices": [0], **{k: getattr(getattr(cfg, role), k) for k in keys}}
                 for role in ("prefill", "decode")}
        path = Path(tempfile.mkdtemp()) / "peers-launch.yaml"
        path.write_text(yaml.safe_dump({
            "mode": "disaggregated", "model": {"name": "smollm2", "dtype": "float32"},
            **pools, "transfer": {"kind": "cross_process"}}))
        self.dv = dv
        self.proc, address = dv.start("launch", "--config", str(path), "--port", "0")
        self.client = Client(address)

    def generate(self, prompts, max_tokens):
        out = [None] * len(prompts)

        def one(i):
            out[i] = self.client.generate(prompts[i], max_tokens=max_tokens, ignore_eos=True)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(o is None for o in out):
            raise RuntimeError("a request to the launched deployment failed")
        return out

    def close(self):
        self.client.close()
        self.dv.stop(self.proc)


def serve_launched(launched, prompts):
    t = time.perf_counter()
    out = launched.generate(prompts, SERVE_NEW)
    wall = time.perf_counter() - t
    if cached := sum(o["timings"].cached_tokens for o in out):
        raise RuntimeError(f"{cached} prompt tokens came from the prefix cache")
    return wall, [list(o["token_ids"]) for o in out]


def serve_ours(engine, prompts):
    """(wall s, token ids per request), and every inter-token gap (s) of the run."""
    params = SamplingParams(max_tokens=SERVE_NEW)
    t = time.perf_counter()
    ids = [engine.submit(p, params, stop_token_ids=[]) for p in prompts]
    results = [engine.result(rid) for rid in ids]
    wall = time.perf_counter() - t
    if cached := sum(r.cached_tokens for r in results):  # would not be a cold prefill
        raise RuntimeError(f"{cached} prompt tokens came from the prefix cache")
    return (wall, [r.token_ids for r in results]), [g for r in results for g in r.tbt_s]


# ------------------------------------------------------------------------ peers

class LlamaCpp:
    def __init__(self, path, fp32: bool):
        from llama_cpp import Llama

        self.name = "llama.cpp " + ("fp32" if fp32 else "default")
        kwargs = dict(flash_attn=False, type_k=0, type_v=0) if fp32 else {}  # 0: GGML F32
        self.m = Llama(str(path), n_ctx=CONTEXT + 64, n_batch=CONTEXT, n_threads=THREADS,
                       verbose=False, **kwargs)
        self.prompt = np.random.default_rng(0).integers(0, 49152, CONTEXT).tolist()

    def prefill_s(self, repeats):
        def run():
            self.m.reset()
            self.m.eval(self.prompt)

        return median_seconds(run, repeats)

    def decode_s(self, repeats):
        self.m.reset()
        self.m.eval(self.prompt)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            self.m.eval([1])
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def _logits(self):
        """The last evaluated token's logits (without logits_all, `scores` stays empty)."""
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.m._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.m.n_vocab(),)).copy()

    def last_logits(self, ids):
        self.m.reset()
        self.m.eval(ids)
        return self._logits()

    def greedy(self, ids, n):
        self.m.reset()
        self.m.eval(ids)
        out = []
        for _ in range(n):
            tok = int(np.argmax(self._logits()))
            out.append(tok)
            self.m.eval([tok])
        return out

    def serve(self, prompts):
        t = time.perf_counter()
        outs = [self.greedy(p, SERVE_NEW) for p in prompts]
        return time.perf_counter() - t, outs


class LlamaCppBatched:
    """llama.cpp decoding many sequences in one context, as its server's parallel slots do.

    llama-cpp-python's `Llama` holds one sequence; its low-level API (the C calls) takes
    a batch of tokens from several sequences per `llama_decode`. Each sequence gets its
    own KV stream (`kv_unified` off, llama-server's layout for parallel slots), so a
    token attends over its own sequence only. KV f32 and flash attention off: the
    all-fp32 settings, whose greedy tokens equal ours.
    """

    def __init__(self, lcpp: LlamaCpp, n_seq: int = SERVE_REQUESTS):
        import llama_cpp

        self.c, self.lcpp = llama_cpp, lcpp  # lcpp owns the model: it must outlive ctx
        self.n_vocab = lcpp.m.n_vocab()
        p = llama_cpp.llama_context_default_params()
        p.n_seq_max, p.kv_unified = n_seq, False
        p.n_ctx = n_seq * (CONTEXT + 256)  # llama.cpp rounds each stream to 256
        p.n_batch, p.n_ubatch = CONTEXT, CONTEXT
        p.n_threads = p.n_threads_batch = THREADS
        p.type_k = p.type_v = 0  # GGML F32
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = llama_cpp.llama_init_from_model(lcpp.m.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a batched context")
        self.batch = llama_cpp.llama_batch_init(CONTEXT, 0, 1)
        self.prompt = lcpp.prompt

    def close(self):
        self.c.llama_batch_free(self.batch)
        self.c.llama_free(self.ctx)

    def _decode(self, items):
        """items: (token, position, sequence, wants logits) -> rows of logits asked for."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if (rc := self.c.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = [i for i, item in enumerate(items) if item[3]]
        return [np.ctypeslib.as_array(self.c.llama_get_logits_ith(self.ctx, i),
                                      shape=(self.n_vocab,)) for i in rows]

    def _prefill(self, prompts):
        """Every prompt in calls of up to CONTEXT tokens; the last token's logits of each."""
        self.c.llama_memory_clear(self.c.llama_get_memory(self.ctx), True)
        items = [(tok, pos, s, pos == len(p) - 1)
                 for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last = []
        for i in range(0, len(items), CONTEXT):
            last += [int(np.argmax(r)) for r in self._decode(items[i:i + CONTEXT])]
        return last

    def decode_s(self, b, repeats):
        """One step for b sequences, each at CONTEXT tokens of context."""
        self._prefill([self.prompt] * b)
        times = []
        for r in range(repeats):
            t = time.perf_counter()
            self._decode([(1, CONTEXT + r, s, True) for s in range(b)])
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def serve(self, prompts):
        t = time.perf_counter()
        nxt = self._prefill(prompts)
        outs = [[tok] for tok in nxt]
        for step in range(SERVE_NEW - 1):
            rows = self._decode([(out[-1], len(p) + step, s, True)
                                 for s, (p, out) in enumerate(zip(prompts, outs, strict=True))])
            for out, row in zip(outs, rows, strict=True):
                out.append(int(np.argmax(row)))
        return time.perf_counter() - t, outs


class HF:
    name = "transformers"

    def __init__(self, gguf):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.m = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        self.prompt = torch.tensor(
            np.random.default_rng(0).integers(0, 49152, (1, CONTEXT)))

    def prefill_s(self, repeats):
        with self.torch.no_grad():
            return median_seconds(lambda: self.m(self.prompt, use_cache=False), repeats)

    def decode_s(self, b, repeats=2):
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        batch = self.prompt.repeat(b, 1)
        with self.torch.no_grad():
            full = median_seconds(lambda: self.m.generate(batch, max_new_tokens=17, **kw),
                                  repeats)
            first = median_seconds(lambda: self.m.generate(batch, max_new_tokens=1, **kw),
                                   repeats)
        return (full - first) / 16

    def last_logits(self, ids):
        with self.torch.no_grad():
            return self.m(self.torch.tensor([ids])).logits[0, -1].float().numpy()

    def greedy(self, ids, n):
        with self.torch.no_grad():
            out = self.m.generate(self.torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()


# ------------------------------------------------------------------------ main

PEER_NAMES = {"hf": "transformers", "lcpp_default": "llama.cpp default",
              "lcpp_fp32": "llama.cpp fp32", "lcppb": "llama.cpp fp32 batched"}


def fmt(s):
    def g(x):
        return f"{x:.3f}" if x < 10 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"

    return f"{g(s['median'])} [{g(s['min'])}-{g(s['max'])}]"


def ggufs() -> tuple[Path, Path]:
    """SmolLM2's GGUF (fetched once) and the F32 GGUF llama.cpp reads, written from it."""
    gguf = fetch("smollm2", quiet=True)
    f32 = Path(tempfile.gettempdir()) / "jaxdisagg-smollm2-f32.gguf"
    if not f32.exists():
        write_f32_gguf(gguf, f32)
    return gguf, f32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-serving", action="store_true", help="skip the serving workload")
    p.add_argument("--launch", action="store_true",
                   help="serve the workload through `jaxdisagg launch` too (two processes, "
                        "a core each)")
    p.add_argument("--out", default="benchmarks/results/peers.json")
    args = p.parse_args(argv)

    gguf, f32 = ggufs()
    model, tok = load_model(str(gguf), jnp.float32)
    ours, hf = Ours(model), HF(gguf)
    lcpp = {"default": LlamaCpp(f32, fp32=False), "fp32": LlamaCpp(f32, fp32=True)}
    batched = LlamaCppBatched(lcpp["fp32"])

    # Correctness: logits and greedy tokens on a chat prompt.
    chat = tok.encode(tok.chat_template.render(
        [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]))
    ref = ReferenceGenerator(model)
    want = ref.generate([chat], SamplingParams(max_tokens=NEW_CHECK), stop_token_ids=[])[0]
    logits_ours = []
    list(ref.stream([chat], SamplingParams(max_tokens=1), stop_token_ids=[],
                    logits_out=logits_ours))
    mine = np.asarray(logits_ours[0][0])
    check = {}
    for name, peer in (("transformers", hf), *((f"llama.cpp {k}", v) for k, v in lcpp.items())):
        theirs = peer.last_logits(chat)
        check[name] = {"max_abs_logit_diff": float(np.abs(theirs - mine).max()),
                       "same_greedy_tokens": peer.greedy(chat, NEW_CHECK) == want}
        print(f"correctness vs {name}: max |logit diff| {check[name]['max_abs_logit_diff']:.2e}"
              f", same {NEW_CHECK} greedy tokens: {check[name]['same_greedy_tokens']}",
              flush=True)

    # Every round serves prompts no system has seen: our engines keep a prefix cache
    # across calls (llama.cpp's context is cleared per run), and the same prompts again
    # would let round 2 on skip most of our prefill. The warm-up prompt is its own too.
    engines, round_prompts, prompts, launched = {}, [], [], None
    if not args.no_serving:
        engines = {name: Engine.from_config(cfg) for name, cfg in serving_configs().items()}
        rng = np.random.default_rng(1)
        warm, *round_prompts = ([rng.integers(3, 49152, SERVE_PROMPT).tolist()
                                 for _ in range(SERVE_REQUESTS)] for _ in range(args.rounds + 1))
        for e in engines.values():
            e.generate([warm[0]], SamplingParams(max_tokens=2))  # first calls, excluded
        if args.launch:
            launched = Launched()
            launched.generate([warm[1]], 2)

    def lcpp_job(k, v):
        return lambda: {f"lcpp_{k}_prefill": v.prefill_s(args.repeats),
                        f"lcpp_{k}_decode_b1": v.decode_s(4 * args.repeats)}

    def serve_job(name, eng):
        def job():
            served, gaps = serve_ours(eng, prompts)
            return {f"{name}_serve": served, f"{name}_tbt": gaps}
        return job

    jobs = [
        lambda: {"ours_prefill": ours.prefill_s(args.repeats),
                 "ours_decode_b1": ours.decode_s(1, 4 * args.repeats),
                 "ours_decode_b8": ours.decode_s(8, 2 * args.repeats)},
        lambda: {"hf_prefill": hf.prefill_s(args.repeats), "hf_decode_b1": hf.decode_s(1),
                 "hf_decode_b8": hf.decode_s(8)},
        *(lcpp_job(k, v) for k, v in lcpp.items()),
        *(serve_job(name, eng) for name, eng in engines.items()),
    ]
    if launched is not None:
        jobs.append(lambda: {"launched_serve": serve_launched(launched, prompts)})
    jobs.append(lambda: {"lcppb_decode_b8": batched.decode_s(8, 2 * args.repeats)})
    if engines:
        jobs.append(lambda: {"lcpp_fp32_serve": lcpp["fp32"].serve(prompts)})
        jobs.append(lambda: {"lcppb_serve": batched.serve(prompts)})
    rounds = []
    for r in range(args.rounds):
        prompts[:] = round_prompts[r] if round_prompts else []
        row: dict = {}
        for job in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:  # the order rotates
            row.update(job())
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    times = {k: spread([rd[k] for rd in rounds]) for k in rounds[0]
             if not k.endswith(("_serve", "_tbt"))}
    table = []
    for what, mine_key, peers_keys in (
            ("prefill 512", "ours_prefill", ("hf_prefill", "lcpp_default_prefill",
                                             "lcpp_fp32_prefill")),
            ("decode B=1", "ours_decode_b1", ("hf_decode_b1", "lcpp_default_decode_b1",
                                              "lcpp_fp32_decode_b1")),
            ("decode B=8", "ours_decode_b8", ("hf_decode_b8", "lcppb_decode_b8"))):
        for key in peers_keys:
            ratio = spread([rd[mine_key] / rd[key] for rd in rounds])
            peer = PEER_NAMES[key.split("_prefill")[0].split("_decode")[0]]
            table.append((what, peer, times[mine_key], times[key], ratio))
    print(f"\nSmolLM2-135M fp32, {THREADS} threads, {args.rounds} rounds, "
          f"median [range]; ratio = ours / peer time (< 1: ours faster)\n")
    print(f"{'measurement':<14}{'peer':<20}{'ours ms':>24}{'peer ms':>24}{'ratio':>24}")
    for what, peer, mine_t, their_t, ratio in table:
        ms = lambda s: {k: v * 1e3 for k, v in s.items()}  # noqa: E731
        print(f"{what:<14}{peer:<20}{fmt(ms(mine_t)):>24}{fmt(ms(their_t)):>24}"
              f"{fmt(ratio):>24}")
    serving = {}
    if engines:
        total = SERVE_REQUESTS * SERVE_NEW
        print(f"\nserving {SERVE_REQUESTS} x {SERVE_PROMPT}-token prompts x {SERVE_NEW} new "
              "tokens (generated tok/s; ratio = ours / llama.cpp's throughput, > 1: ours "
              "faster; llama.cpp fp32 one sequence at a time, and batched)")
        base = {"llama.cpp fp32": "lcpp_fp32", "llama.cpp batched": "lcppb"}
        ours_keys = [(n, n) for n in engines]
        if launched is not None:
            ours_keys.append(("disaggregated, launch", "launched"))
        for name, key in (*base.items(), *ours_keys):
            runs = [rd[f"{key}_serve"] for rd in rounds]
            serving[name] = {"tokens_per_s": spread([total / w for w, _ in runs])}
            line = f"  {name:<22}{fmt(serving[name]['tokens_per_s']):>24}"
            for peer, pkey in base.items():
                if pkey == key:  # llama.cpp batched against one at a time, not itself
                    break
                theirs = [rd[f"{pkey}_serve"] for rd in rounds]
                ratio = spread([lw / w for (w, _), (lw, _) in zip(runs, theirs, strict=True)])
                same = statistics.fmean(
                    float(a == b) for (_, mt), (_, lt) in zip(runs, theirs, strict=True)
                    for a, b in zip(mt, lt, strict=True))
                serving[name][f"vs {peer}"] = {"ratio": ratio, "same_tokens": same}
                line += f"   vs {peer}: {fmt(ratio)}, same tokens {same:.2f}"
            if f"{key}_tbt" in rounds[0]:  # what the throughput costs each stream
                tbt = {f"p{q}": spread([1e3 * float(np.percentile(rd[f"{key}_tbt"], q))
                                        for rd in rounds]) for q in (50, 99)}
                serving[name]["tbt_ms"] = tbt
                line += f"   TBT p50 {fmt(tbt['p50'])} p99 {fmt(tbt['p99'])} ms"
            print(line)
        for e in engines.values():
            e.close()
        if launched is not None:
            launched.close()
    batched.close()
    write_result(args.out, {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.node(), "cores": THREADS,
        "jax": jax.__version__, "args": vars(args), "correctness": check,
        "rounds_s": [{k: v[0] if k.endswith("_serve") else v for k, v in rd.items()
                      if not k.endswith("_tbt")}
                     for rd in rounds],  # every round's times, to pair within a round
        "times_s": times, "ratios": [{"measurement": w, "peer": p, "ratio": r}
                                     for w, p, _, _, r in table],
        "serving": serving})
    return 0


if __name__ == "__main__":
    sys.exit(main())
