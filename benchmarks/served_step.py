"""The served decode step on CPU, and what the kernels' spinning helper threads or the
greedy sampling kernel buy.

    python benchmarks/served_step.py [--model smollm2] [--busy 1 8] [--rounds 8]
                                     [--repeats 9] [--spin-us 200] [--compare spin|greedy]
                                     [--out benchmarks/results/served_step.json]

One pool instance on one of two host devices (8 slots, fp32, every slot holding a
512-token context over shuffled block tables), stepping `n` busy slots for every `n` of
`--busy` through the program the decode worker runs (`PoolInstance.decode`: the busy
slots only, sampled on the device, tokens copied to the host). Rounds alternate, in one
process, so a ratio is not a comparison of two processes on a noisy machine:
`--compare spin`: the CPU kernels' helper threads spinning `--spin-us` after each call
against parking at once (`cpu.set_helper_spin_us`); `--compare greedy`: the step's
argmax and log-normaliser from `pallas/cpu_sample.cc` against jnp's (a second instance
whose program was traced with `paged.step_greedy` saying no). Each round's figure is
the median of `--repeats` steps. To compare two commits, run the script in each
checkout, alternating. Prints the step times and the ratio (median and range over
rounds); writes JSON.
"""

import os

# The two host devices the peers benchmark uses: XLA:CPU sizes its pool to max(cores, devices).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import spread, write_result  # noqa: E402

from jaxdisagg.mesh.config import PoolConfig  # noqa: E402
from jaxdisagg.mesh.pool import PoolInstance  # noqa: E402
from jaxdisagg.model import SamplingParams, paged  # noqa: E402
from jaxdisagg.model.sampling import row_params  # noqa: E402
from jaxdisagg.model.weights import load_model  # noqa: E402
from jaxdisagg.pallas import cpu  # noqa: E402

CONTEXT, BS, SLOTS = 512, 16, 8


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--busy", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--spin-us", type=int, default=200)
    p.add_argument("--compare", choices=("spin", "greedy"), default="spin")
    p.add_argument("--out", default="benchmarks/results/served_step.json")
    args = p.parse_args(argv)
    if not cpu.available():
        raise SystemExit(f"the CPU kernels are unavailable: {cpu.unavailable_reason()}")

    model, _ = load_model(args.model, jnp.float32)
    vocab = model.config.vocab_size
    pages = CONTEXT // BS + 1
    pool = PoolConfig(devices=[0], tp=1, block_size=BS, num_blocks=SLOTS * pages + 1,
                      chunk_size=CONTEXT, max_slots=SLOTS, max_pages_per_request=pages)
    rng = np.random.default_rng(0)
    tables = rng.permutation(SLOTS * pages).astype(np.int32).reshape(SLOTS, pages)
    prompt = rng.integers(0, vocab, CONTEXT).astype(np.int32)

    def instance(name):
        inst = PoolInstance(name, model, [0], pool, backend="auto")
        for slot in range(SLOTS):
            inst.prefill(prompt, 0, CONTEXT, tables[slot]).block_until_ready()
        return inst

    @contextlib.contextmanager
    def jnp_sampling():  # while a program is traced: jnp's argmax and log_softmax
        kept = paged.step_greedy
        paged.step_greedy = lambda backend, mesh, logits: None
        try:
            yield
        finally:
            paged.step_greedy = kept

    inst = instance("step")
    if args.compare == "spin":
        modes = {"spin": (inst, lambda: cpu.set_helper_spin_us(args.spin_us)),
                 "park": (inst, lambda: cpu.set_helper_spin_us(0))}
    else:
        modes = {"kernel": (inst, lambda: None), "jnp": (instance("jnp"), lambda: None)}
    (a, b) = modes
    rows = []
    for n in args.busy:
        busy = np.arange(SLOTS) < n
        tokens = np.ones(SLOTS, np.int32)
        pos = np.where(busy, CONTEXT, 0).astype(np.int32)
        lens = np.where(busy, CONTEXT + 1, 0).astype(np.int32)
        params = row_params([SamplingParams() if on else None for on in busy], 1, vocab)

        def step(inst, args=(tokens, pos, tables, lens, params)):
            new, _ = inst.decode(*args)
            return np.asarray(new)

        for mode, (one, _) in modes.items():
            with jnp_sampling() if mode == "jnp" else contextlib.nullcontext():
                for _ in range(3):
                    step(one)
        same = [step(one).tolist() for one, _ in modes.values()]
        assert same[0] == same[1], f"{a} and {b} chose different tokens: {same}"
        times = {a: [], b: []}
        for r in range(args.rounds):
            for mode in ((a, b) if r % 2 == 0 else (b, a)):
                one, prep = modes[mode]
                prep()
                step(one)
                ts = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    step(one)
                    ts.append(time.perf_counter() - t0)
                times[mode].append(float(np.median(ts)))
        cpu.set_helper_spin_us(args.spin_us)
        ratio = list(np.array(times[a]) / np.array(times[b]))
        row = {"busy": n, f"{a}_s": times[a], f"{b}_s": times[b],
               "ratio": spread([float(x) for x in ratio])}
        rows.append(row)
        print(f"{n} busy: {a} {np.median(times[a]) * 1e3:.1f} ms "
              f"[{min(times[a]) * 1e3:.1f}-{max(times[a]) * 1e3:.1f}], {b} "
              f"{np.median(times[b]) * 1e3:.1f} ms [{min(times[b]) * 1e3:.1f}-"
              f"{max(times[b]) * 1e3:.1f}]; {a} / {b} "
              f"{row['ratio']['median']:.2f} [{row['ratio']['min']:.2f}-"
              f"{row['ratio']['max']:.2f}] over {args.rounds} rounds", flush=True)
    write_result(args.out, {
        "benchmark": "served_step", "model": args.model, "context": CONTEXT,
        "slots": SLOTS, "spin_us": args.spin_us, "compare": f"{a} / {b}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "rounds": args.rounds, "repeats": args.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
