"""KV transfer between disjoint sub-meshes: bandwidth and how much of it prefill hides.

The `small` preset in fp32 on 8 CPU devices: prefill on devices 0-3 (tp=4), decode
on 4-7 (tp=4, same layout) or 4-5 (tp=2, resharded). For one long prompt:

* bandwidth: the request's whole KV moved with nothing else running, against a
  same-run host memcpy of the same bytes and a same-layout `device_put`;
* exposed time: from the end of prefill compute to the KV ready in the decode
  pool, with layer streaming (each layer group's KV leaves as soon as the group
  is dispatched) and without (all KV leaves after the last layer);
* cross-process: the same KV offered by this process (tp=4) and pulled by a
  second process (its own 4 CPU devices, tp=2) through jax.experimental.transfer.

    python benchmarks/transfer.py [--prompt 1024] [--repeats 5] [--group 1] [--out FILE]

Exposed fraction = exposed time / standalone transfer time of the same KV.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import median_seconds, write_result  # noqa: E402

from jaxdisagg.mesh import finish_transfer, prefill_request  # noqa: E402
from jaxdisagg.mesh.config import PoolConfig  # noqa: E402
from jaxdisagg.mesh.pool import PoolInstance  # noqa: E402
from jaxdisagg.mesh.transfer import InProcessTransfer  # noqa: E402
from jaxdisagg.model import Llama, get_preset  # noqa: E402

BLOCK = 16


def run_pair(model, dst_tp, prompt, repeats, group):
    pages = len(prompt) // BLOCK
    cfg = dict(num_blocks=2 * pages + 1, block_size=BLOCK, chunk_size=512, max_slots=1,
               max_pages_per_request=pages)
    src = PoolInstance("prefill", model, [0, 1, 2, 3], PoolConfig(devices=[0, 1, 2, 3], tp=4,
                                                                  **cfg), layer_group_size=group)
    dst_devices = list(range(4, 4 + dst_tp))
    dst = PoolInstance("decode", model, dst_devices, PoolConfig(devices=dst_devices, tp=dst_tp,
                                                                **cfg), layer_group_size=group)
    xfer = InProcessTransfer(src, dst)
    blocks = list(range(pages))
    all_layers = range(model.config.num_layers)

    def standalone():
        parts = xfer.extract(all_layers, blocks)
        xfer.insert(parts, blocks)
        jax.block_until_ready(dst.kv)
        return sum(p.nbytes for p in parts)

    nbytes = standalone()
    t_alone = median_seconds(standalone, repeats)

    def request(streaming):
        logits, parts, first = prefill_request(src, prompt, blocks, xfer, streaming)
        return finish_transfer(xfer, logits, parts, blocks, first)

    out = {"dst_tp": dst_tp, "bytes": nbytes, "standalone_s": t_alone,
           "standalone_gbs": nbytes / t_alone / 1e9}
    for streaming in (True, False):
        request(streaming)  # warm
        stats = [request(streaming) for _ in range(repeats)]
        key = "streamed" if streaming else "whole"
        out[f"{key}_exposed_s"] = statistics.median(s.exposed_s for s in stats)
        out[f"{key}_exposed_fraction"] = out[f"{key}_exposed_s"] / t_alone
    t0 = time.perf_counter()
    logits, _, _ = prefill_request(src, prompt, blocks)
    jax.block_until_ready(logits)
    out["prefill_s"] = time.perf_counter() - t0
    return out


def pool_config(pages, devices, tp):
    return PoolConfig(devices=devices, tp=tp, num_blocks=2 * pages + 1, block_size=BLOCK,
                      chunk_size=512, max_slots=1, max_pages_per_request=pages)


def peer_main(pages: int) -> None:
    """The decode process of the cross-process measurement."""
    from jaxdisagg.mesh.control import ControlServer
    from jaxdisagg.mesh.xproc import KVOffer, KVReceiver

    inst = PoolInstance("decode", Llama(get_preset("small"), seed=0), [0, 1],
                        pool_config(pages, [0, 1], 2))
    receiver = KVReceiver(inst, pull_timeout_s=60)

    def receive(msg):
        stats = receiver.insert([KVOffer.from_json(o) for o in msg["offers"]],
                                list(range(pages)))
        return {"bytes": stats.bytes_moved, "transfer_s": stats.transfer_s}

    server = ControlServer({"receive": receive})
    print("READY", server.address, flush=True)
    time.sleep(600)


def cross_process(model, prompt, repeats) -> dict:
    import subprocess

    from jaxdisagg.mesh.control import ControlClient
    from jaxdisagg.mesh.xproc import KVSender

    pages = len(prompt) // BLOCK
    src = PoolInstance("prefill", model, [0, 1, 2, 3], pool_config(pages, [0, 1, 2, 3], 4))
    blocks = list(range(pages))
    logits, _, _ = prefill_request(src, prompt, blocks)
    jax.block_until_ready(logits)
    sender = KVSender(src, lease_s=120)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    peer = subprocess.Popen([sys.executable, __file__, "--peer", str(pages)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        client = ControlClient(peer.stdout.readline().split()[1])
        runs = []
        for _ in range(repeats + 1):  # the first compiles the peer's programs
            offers = sender.extract(range(model.config.num_layers), blocks, "bench")
            t = time.perf_counter()
            got = client.call("receive", {"offers": [o.to_json() for o in offers]},
                              timeout=120)
            runs.append((got["bytes"], got["transfer_s"], time.perf_counter() - t))
        runs = runs[1:]
    finally:
        peer.kill()
        sender.close()
    nbytes = runs[0][0]
    pull = statistics.median(r[1] for r in runs)
    return {"bytes": nbytes, "pull_s": pull, "gbs": nbytes / pull / 1e9,
            "round_trip_s": statistics.median(r[2] for r in runs)}


def memcpy_gbs(nbytes, repeats):
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    return nbytes / median_seconds(lambda: np.copyto(b, a), repeats) / 1e9


def device_put_gbs(nbytes, repeats):
    """Same-layout single-device copy (device 0 -> 4): the fast path the shards use."""
    x = jax.device_put(np.ones(nbytes // 4, np.float32), jax.devices()[0])
    target = jax.devices()[4]
    return nbytes / median_seconds(lambda: jax.device_put(x, target).block_until_ready(),
                                repeats) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--group", type=int, default=1, help="layers per streamed group")
    p.add_argument("--out", default="benchmarks/results/transfer.json")
    p.add_argument("--peer", type=int, help=argparse.SUPPRESS)  # internal: the decode process
    args = p.parse_args(argv)
    if args.peer:
        peer_main(args.peer)
        return 0

    model = Llama(get_preset("small"), seed=0)
    prompt = np.random.default_rng(0).integers(0, 32000, args.prompt).tolist()
    rows = [run_pair(model, tp, prompt, args.repeats, args.group) for tp in (4, 2)]
    nbytes = rows[0]["bytes"]
    result = {"prompt_tokens": args.prompt, "layer_group_size": args.group,
              "memcpy_gbs": memcpy_gbs(nbytes, args.repeats * 4),
              "device_put_gbs": device_put_gbs(nbytes, args.repeats * 4),
              "pairs": rows, "cross_process": cross_process(model, prompt, args.repeats),
              "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    print(f"small preset fp32, prompt {args.prompt} tokens, KV {nbytes / 1e6:.1f} MB, "
          f"layer groups of {args.group}; host memcpy {result['memcpy_gbs']:.1f} GB/s, "
          f"same-layout device_put {result['device_put_gbs']:.1f} GB/s")
    print(f"  {'prefill tp4 ->':<16}{'standalone':>12}{'GB/s':>8}{'prefill':>10}"
          f"{'exposed (streamed)':>22}{'exposed (whole)':>20}")
    for r in rows:
        print(f"  {'decode tp' + str(r['dst_tp']):<16}{r['standalone_s'] * 1e3:>10.1f}ms"
              f"{r['standalone_gbs']:>8.2f}{r['prefill_s'] * 1e3:>8.0f}ms"
              f"{r['streamed_exposed_s'] * 1e3:>12.1f}ms ({r['streamed_exposed_fraction']:>4.0%})"
              f"{r['whole_exposed_s'] * 1e3:>10.1f}ms ({r['whole_exposed_fraction']:>4.0%})")
    x = result["cross_process"]
    print(f"  cross-process tp4 -> tp2 (second process): {x['bytes'] / 1e6:.1f} MB pulled in "
          f"{x['pull_s'] * 1e3:.1f} ms = {x['gbs']:.2f} GB/s (control round trip "
          f"{x['round_trip_s'] * 1e3:.1f} ms)")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
