"""The cost model of disaggregated serving as code (the roofline argument: README, "Why").

One iteration of a model with P parameters of b bytes, T tokens in the iteration,
B requests each holding L tokens of context, and K_tok KV bytes per token summed
over the layers (2 * layers * kv_heads * head_dim * b):

    bytes = P*b + K_tok*L*B        FLOPs = 2*P*T        I = FLOPs / bytes

Decode has T = B; a prefill chunk of C tokens over a cached prefix of S has T = C
and reads K_tok*S of KV. The ridge point R = peak FLOP/s / bandwidth splits
compute-bound (I > R) from bandwidth-bound, and a roofline step-time estimate is
max(FLOPs / peak, bytes / bandwidth). The KV term equals the weight term at
L*B = P*b / K_tok: past it a bigger decode batch no longer raises I.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxdisagg.model.config import LlamaConfig


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # sustained dense matmul FLOP/s at the model dtype (not the datasheet peak)
    bandwidth: float  # memory bytes/s
    memory: float  # device memory, bytes (0: unknown)
    rates: str = "sustained"  # what `flops` is: "sustained" (large matmuls reach it) or "measured"

    @property
    def ridge(self) -> float:
        return self.flops / self.bandwidth


# Sustained matmul rates, as the article uses them (H100: ~500 of the 989 dense TFLOP/s
# a datasheet lists), and the datasheets' memory bandwidth: an H200's device copy
# reached 68% of it (benchmarks/plan_study.py takes the measured fraction). The CPU
# entry is this project's 2-core development machine as measured by
# benchmarks/model_cpu.py (fp32); `--calibrate` measures the machine at hand.
HARDWARE = {
    "h100-sxm": Hardware("H100 SXM", 500e12, 3.35e12, 80e9),
    "h200": Hardware("H200", 500e12, 4.8e12, 141e9),
    "a100-sxm": Hardware("A100 SXM 80GB", 250e12, 2.0e12, 80e9),
    "cpu-2core": Hardware("2-core CPU (fp32)", 153e9, 26.4e9, 24e9, "measured"),
}

# Bytes/s one way between a prefill and a decode device.
FABRICS = {
    "nvlink": 450e9,  # NVLink 4, per direction (H100/H200)
    "pcie5": 50e9,  # PCIe Gen5 x16, effective
    "infiniband": 50e9,  # NDR 400 Gb/s
    "loopback": 0.24e9,  # jax.experimental.transfer between two CPU processes (measured)
}


@dataclass(frozen=True)
class Model:
    name: str
    params: int
    bytes_per_param: int
    kv_bytes_per_token: int  # K_tok, all layers, K and V
    head_params: int = 0  # the LM head (vocab x hidden)
    embed_params: int = 0  # an untied input embedding (gathered, never multiplied)
    attn_flops_per_pair: int = 0  # QK^T and PV: 4 * layers * heads * head_dim per (q, k)

    @classmethod
    def from_config(cls, cfg: LlamaConfig, dtype_bytes: int = 2) -> Model:
        head = cfg.vocab_size * cfg.hidden_size
        return cls(cfg.name, cfg.num_params(), dtype_bytes,
                   2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes,
                   head, 0 if cfg.tie_word_embeddings else head,
                   4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)

    @property
    def dense_params(self) -> int:
        """What every token multiplies through: all but the head and the embedding."""
        return self.params - self.head_params - self.embed_params

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class Point:
    """One iteration's cost on one device (or one pool treated as one)."""

    label: str
    tokens: int
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    def regime(self, hw: Hardware) -> str:
        return "compute" if self.intensity > hw.ridge else "bandwidth"

    def time(self, hw: Hardware) -> float:
        return max(self.flops / hw.flops, self.bytes / hw.bandwidth)


def decode_point(m: Model, batch: int, context: int) -> Point:
    return Point(f"decode B={batch} L={context}", batch, 2 * m.params * batch,
                 m.weight_bytes + m.kv_bytes_per_token * context * batch)


def prefill_point(m: Model, chunk: int, prefix: int) -> Point:
    return Point(f"prefill C={chunk} S={prefix}", chunk, 2 * m.params * chunk,
                 m.weight_bytes + m.kv_bytes_per_token * prefix)


def served_point(m: Model, kind: str, tokens: int, kv_tokens: int, logits_rows: int,
                 pairs: float = 0.0) -> Point:
    """The cost as this project's programs incur it, refining the article's 2*P*T: the
    embedding is a gather (no FLOPs, and only the rows used are read), the LM head runs
    only for rows that need logits (every decode slot, a prefill chunk's last token),
    and attention adds its (query, key) pairs."""
    b = m.bytes_per_param
    flops = (2 * m.dense_params * tokens + 2 * m.head_params * logits_rows
             + m.attn_flops_per_pair * pairs)
    bytes_ = (m.dense_params + m.head_params) * b + m.kv_bytes_per_token * kv_tokens
    return Point(kind, tokens, flops, bytes_)


def crossover_tokens(m: Model) -> float:
    """L*B at which the batch's KV bytes equal the weight bytes."""
    return m.weight_bytes / m.kv_bytes_per_token


def transfer_seconds(m: Model, prompt_tokens: int, fabric_bytes_per_s: float) -> float:
    return prompt_tokens * m.kv_bytes_per_token / fabric_bytes_per_s


# ---------------------------------------------------------------------- tables


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def report_data(m: Model, hw: Hardware, batches=(1, 8, 32, 128),
                contexts=(512, 2048, 8192, 32768), chunks=(512, 2048),
                prefixes=(0, 8192, 32768), prompt=4096) -> dict:
    """Every figure `report` prints, as plain data (the CLI's --json).

    Step times come two ways: the article's (2*P*T FLOPs; weights + KV bytes) and
    with attention counted (`refined`: QK^T and PV over the cached context, the LM
    head only where logits are needed), which is what dominates at long context."""
    free = hw.memory - m.weight_bytes
    decode = []
    for b in batches:
        for length in contexts:
            p = decode_point(m, b, length)
            kv = m.kv_bytes_per_token * length * b
            decode.append({"batch": b, "context": length, "intensity": p.intensity,
                           "regime": p.regime(hw), "step_s": p.time(hw),
                           "step_with_attention_s": refined(m, p).time(hw),
                           "kv_bytes": kv, "fits": kv <= free})
    prefill = []
    for c in chunks:
        for s in prefixes:
            p = prefill_point(m, c, s)
            prefill.append({"chunk": c, "prefix": s, "intensity": p.intensity,
                            "regime": p.regime(hw), "step_s": p.time(hw),
                            "step_with_attention_s": refined(m, p).time(hw)})
    return {
        "model": {"name": m.name, "params": m.params, "weight_bytes": m.weight_bytes,
                  "bytes_per_param": m.bytes_per_param,
                  "kv_bytes_per_token": m.kv_bytes_per_token},
        "hardware": {"name": hw.name, "flops": hw.flops, "bandwidth": hw.bandwidth,
                     "memory": hw.memory, "ridge": hw.ridge, "rates": hw.rates},
        "decode": decode, "prefill": prefill,
        "crossover_tokens": crossover_tokens(m), "crossover_batches": list(batches),
        "transfer": {"prompt_tokens": prompt, "kv_bytes": prompt * m.kv_bytes_per_token,
                     "seconds": {name: transfer_seconds(m, prompt, bw)
                                 for name, bw in FABRICS.items()}},
    }


def report(m: Model, hw: Hardware, **cases) -> str:
    d = report_data(m, hw, **cases)
    mem = _si(hw.memory, "B") if hw.memory else "unknown"
    lines = [f"{m.name}: {m.params / 1e9:.3g}B parameters, {_si(m.weight_bytes, 'B')} of weights "
             f"({m.bytes_per_param} B/param), K_tok = {_si(m.kv_bytes_per_token, 'B')}/token",
             f"{hw.name}: {_si(hw.flops, 'FLOP/s')} {hw.rates}, {_si(hw.bandwidth, 'B/s')}, "
             f"ridge R = {hw.ridge:.0f} FLOP/B, {mem} memory", "",
             "decode, one iteration (I = 2PB / (Pb + K_tok L B)); 'step' is the article's "
             "estimate, '+attn' counts attention FLOPs too:",
             f"  {'B':>5} {'L':>7} {'I':>8} {'regime':>10} {'step':>10} {'+attn':>10} "
             f"{'KV of batch':>12} {'fits?':>6}"]
    for r in d["decode"]:
        lines.append(f"  {r['batch']:>5} {r['context']:>7} {r['intensity']:>8.1f} "
                     f"{r['regime']:>10} {r['step_s'] * 1e3:>8.2f}ms "
                     f"{r['step_with_attention_s'] * 1e3:>8.2f}ms {_si(r['kv_bytes'], 'B'):>12} "
                     f"{('yes' if r['fits'] else 'NO') if hw.memory else '?':>6}")
    cross = d["crossover_tokens"]
    lines += ["", f"crossover: KV bytes = weight bytes at L*B = {cross:.0f} "
              + ", ".join(f"(L = {cross / b:.0f} at B = {b})" for b in d["crossover_batches"]),
              "", "prefill of a chunk C over a cached prefix S (I = 2PC / (Pb + K_tok S)); "
              "'+attn' adds the chunk's attention over the prefix and itself:",
              f"  {'C':>5} {'S':>7} {'I':>8} {'regime':>10} {'step':>10} {'+attn':>10}"]
    for r in d["prefill"]:
        lines.append(f"  {r['chunk']:>5} {r['prefix']:>7} {r['intensity']:>8.1f} "
                     f"{r['regime']:>10} {r['step_s'] * 1e3:>8.2f}ms "
                     f"{r['step_with_attention_s'] * 1e3:>8.2f}ms")
    t = d["transfer"]
    lines += ["", f"KV of one {t['prompt_tokens']}-token prompt: {_si(t['kv_bytes'], 'B')}; "
              "transfer time by fabric:"]
    for name, bw in FABRICS.items():
        lines.append(f"  {name:>11}: {_si(bw, 'B/s'):>10}  {t['seconds'][name] * 1e3:9.2f} ms")
    return "\n".join(lines)


def plot(m: Model, hw: Hardware, path: str, measured: list[tuple[Point, float]] = ()) -> str:
    """A log-log roofline with decode and prefill points; `measured` adds (point, seconds)
    as achieved FLOP/s at the point's intensity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [10 ** (k / 20) for k in range(-20, 100)]
    ax.plot(xs, [min(hw.flops, x * hw.bandwidth) for x in xs], "k-", label=f"{hw.name} roof")
    ax.axvline(hw.ridge, color="grey", ls=":", label=f"ridge {hw.ridge:.0f}")
    for b, marker in ((1, "o"), (32, "s"), (128, "^")):
        pts = [decode_point(m, b, length) for length in (512, 4096, 32768)]
        ax.plot([p.intensity for p in pts], [p.flops / p.time(hw) for p in pts], marker,
                ls="--", label=f"decode B={b} (L 512, 4k, 32k)")
    pts = [prefill_point(m, 2048, s) for s in (0, 8192, 32768)]
    ax.plot([p.intensity for p in pts], [p.flops / p.time(hw) for p in pts], "D", ls="--",
            label="prefill C=2048 (S 0, 8k, 32k)")
    for p, seconds in measured:
        ax.plot([p.intensity], [p.flops / seconds], "r*", ms=12)
        ax.annotate(f"measured {p.label}", (p.intensity, p.flops / seconds), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"{m.name} on {hw.name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- calibration


def median_seconds(fn, repeats: int = 5) -> float:
    """Median wall time of fn() over `repeats` calls, after one warm-up call; fn must
    block until its work is done. (The benchmark scripts time with it too.)"""
    import statistics
    import time

    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_ceilings() -> Hardware:
    """This machine's fp32 matmul rate and weight-streaming bandwidth, as one Hardware."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((512, 2048), np.float32))
    b = jnp.asarray(rng.standard_normal((2048, 2048), np.float32))
    w = jnp.asarray(rng.standard_normal((8192, 8192), np.float32))  # 256 MiB: past the caches
    x = jnp.asarray(rng.standard_normal((8192,), np.float32))
    dot = jax.jit(jnp.dot)
    flops = 2 * 512 * 2048 * 2048 / median_seconds(lambda: dot(a, b).block_until_ready())
    bw = w.nbytes / median_seconds(lambda: dot(w, x).block_until_ready())
    return Hardware("this machine (fp32, measured)", flops, bw, host_memory_bytes(), "measured")


def host_memory_bytes() -> float:
    """This machine's physical memory (what a CPU pool's KV competes for), or 0."""
    import os

    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def measure_matmul_rate(rows: int) -> float:
    """fp32 FLOP/s of a [rows, 2048] x [2048, 2048] product: a decode batch's shape."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((rows, 2048), np.float32))
    b = jnp.asarray(rng.standard_normal((2048, 2048), np.float32))
    dot = jax.jit(jnp.dot)
    return 2 * rows * 2048 * 2048 / median_seconds(lambda: dot(a, b).block_until_ready())


def measure_steps(preset: str, chunk: int = 512, batch: int = 8, context: int = 512
                  ) -> list[tuple[Point, float]]:
    """This project's own prefill and decode step times on `preset` in fp32."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxdisagg.model.paged import KVLayout, jit_serving_fns
    from jaxdisagg.model.weights import load_model

    model, _ = load_model(preset, "float32")
    m = Model.from_config(model.config, 4)
    bs = 16
    pages = -(-(context + chunk) // bs)
    layout = KVLayout.for_model(model.config, batch * pages + 1, bs)
    graphdef, state = nnx.split(model)
    fns = jit_serving_fns(graphdef)
    kv = [layout.allocate()]
    table = np.arange(pages, dtype=np.int32)
    tokens = np.ones(chunk, np.int32)

    def prefill():
        logits, kv[0] = fns.prefill(state, kv[0], tokens, np.int32(0), np.int32(chunk), table)
        jax.block_until_ready(logits)

    tables = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    pos = np.full(batch, context, np.int32)

    def decode():
        logits, kv[0] = fns.decode(state, kv[0], np.ones(batch, np.int32), pos, tables,
                                   pos + 1)
        jax.block_until_ready(logits)

    return [(prefill_point(m, chunk, 0), median_seconds(prefill)),
            (decode_point(m, batch, context), median_seconds(decode))]


def refined(m: Model, p: Point) -> Point:
    """The `served_point` of an article point made by prefill_point / decode_point."""
    kind, rest = p.label.split(" ", 1)
    a, b = (int(x.split("=")[1]) for x in rest.split())
    if kind == "prefill":  # C=a over S=b: KV of the prefix and the chunk, logits once
        return served_point(m, p.label, a, b + a, 1, a * (b + (a + 1) / 2))
    return served_point(m, p.label, a, a * b, a, a * b)  # decode B=a at L=b


def calibration_report(m: Model, hw: Hardware, measured: list[tuple[Point, float]],
                       small_m_flops: float | None = None) -> str:
    """Predicted against measured step times, three ways: the article's 2*P*T on the
    peak matmul rate; the refined cost (`served_point`); and the refined cost with the
    matmul rate measured at the decode batch's own shape (a CPU's small-M products run
    far below its peak)."""
    lines = [f"measured ceilings: {_si(hw.flops, 'FLOP/s')} matmul, "
             f"{_si(hw.bandwidth, 'B/s')} streaming (ridge {hw.ridge:.1f} FLOP/B)"
             + (f", {_si(small_m_flops, 'FLOP/s')} at the decode batch's M"
                if small_m_flops else ""),
             f"  {'step':<20} {'measured':>9} {'article':>16} {'refined':>16} "
             f"{'refined, M-rate':>16}"]
    for p, seconds in measured:
        r = refined(m, p)
        small = dataclasses.replace(hw, flops=small_m_flops) if (
            small_m_flops and p.label.startswith("decode")) else hw
        cells = [f"{t * 1e3:7.1f}ms {(t - seconds) / seconds:+6.0%}"
                 for t in (p.time(hw), r.time(hw), r.time(small))]
        lines.append(f"  {p.label:<20} {seconds * 1e3:7.1f}ms " + " ".join(
            f"{c:>16}" for c in cells))
    return "\n".join(lines)
