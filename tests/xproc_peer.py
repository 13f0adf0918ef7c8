"""A decode-side pool process for the cross-process transfer tests.

    python tests/xproc_peer.py TP PULL_TIMEOUT_S
    python tests/xproc_peer.py --config FILE

Builds a decode pool (the tiny model's on TP of its own 4 CPU devices, or the decode
role of a deployment config), a KVReceiver, and a control server; prints
"READY <control address>" and serves until told to stop (at most 5 minutes).
"""

import os
import sys
import threading

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_util import decode_greedy, make_pool, pages_digest  # noqa: E402

from jaxdisagg.mesh.control import ControlServer  # noqa: E402
from jaxdisagg.mesh.deployment import Deployment  # noqa: E402
from jaxdisagg.mesh.xproc import KVOffer, KVReceiver  # noqa: E402
from jaxdisagg.model import Llama, get_preset  # noqa: E402


def main():
    if sys.argv[1] == "--config":
        dep = Deployment.build(sys.argv[2], role="decode")
        inst = dep.pools["decode"][0]
        timeout = dep.config.transfer.pull_timeout_s
    else:
        tp, timeout = int(sys.argv[1]), float(sys.argv[2])
        inst = make_pool(Llama(get_preset("tiny"), seed=0), list(range(tp)), tp)
    receiver = KVReceiver(inst, pull_timeout_s=timeout)
    done = threading.Event()

    def receive(msg):
        offers = [KVOffer.from_json(o) for o in msg["offers"]]
        receiver.insert(offers, msg["dst_blocks"])
        return {"digest": pages_digest(inst, msg["dst_blocks"])}

    def decode(msg):
        return {"tokens": decode_greedy(inst, msg["first_token"], msg["prompt_len"],
                                        msg["dst_blocks"], msg["steps"])}

    def stop(msg):
        done.set()
        return {}

    server = ControlServer({"receive": receive, "decode": decode, "stop": stop})
    print("READY", server.address, flush=True)
    done.wait(300)
    server.stop()
    os._exit(0)  # an abandoned (hung) pull thread must not keep the process alive


if __name__ == "__main__":
    main()
