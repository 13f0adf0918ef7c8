"""KV transfer between processes: `jax.experimental.transfer` for the bytes, JSON over
gRPC (`control.py`) for the control messages.

* The sender (prefill process) stages a request's pages, offers each piece (one
  single-device array per set of original KV heads) to its transfer server under
  a fresh uuid, and describes the offer in a `KVOffer`: shapes, dtype, heads per
  piece, its addresses and a compatibility hash. It keeps the pieces alive until
  the receiver releases them, or until the lease runs out.
* The receiver (decode process) checks the hash before any pull, pulls each piece
  onto one of its own devices under our own watchdog (a pull of a uuid nobody
  offers hangs forever, and cannot be cancelled), assembles them into its pool's sharding and
  scatters them in, then releases the offer.

Per-piece offers make any pair of tensor-parallel degrees work: the receiver
never has to match the sender's sharding.

The transfer server itself has no authentication: whoever knows an offer's uuid
can pull it. So a uuid is 63 random bits, never a counter, and it travels only
inside answers of the authenticated control channel (`control.py`): a process
without the deployment secret never sees one, and guessing one is hopeless.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import transfer as jax_transfer
from jax.sharding import SingleDeviceSharding

from jaxdisagg.mesh.control import ControlClients, ControlServer
from jaxdisagg.mesh.pool import PoolInstance
from jaxdisagg.mesh.transfer import (
    HEAD_AXIS,
    InFlightKV,
    KVSink,
    KVSource,
    Piece,
    TransferStats,
    page_runs,
)

TRANSPORT_ADDRESSES = 1  # both peers must start their transfer servers with the same count


class KVTransferError(RuntimeError):
    """A cross-process transfer that failed; the message says which request and why."""


def compat_hash(inst: PoolInstance) -> str:
    """Model, dtype and block layout: what must match for pages to be interchangeable."""
    cfg = inst.config.replace(num_kv_heads=inst.config.num_kv_heads // inst.kv_replication)
    key = {"model": dataclasses.asdict(cfg), "dtype": inst.layout.dtype,
           "block_size": inst.layout.block_size}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KVOffer:
    """What the receiver needs to pull one request's pages of some layers (JSON-able)."""

    request_id: str
    uuid: int
    transfer_address: str  # the sender's jax transfer server
    control_address: str  # the sender's control server (for release)
    compat: str
    layers: tuple[int, int]
    num_pages: int
    nbytes: int
    dtype: str
    shapes: tuple[tuple[int, ...], ...]  # one per piece
    heads: tuple[tuple[int, ...], ...]  # original KV heads of each piece
    offset: int = 0  # where these pages start in the request's block list

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> KVOffer:
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"KVOffer fields {sorted(set(data) ^ names)} missing or unknown")
        data = dict(data)
        data["layers"] = tuple(data["layers"])
        data["shapes"] = tuple(tuple(int(d) for d in s) for s in data["shapes"])
        data["heads"] = tuple(tuple(int(h) for h in hs) for hs in data["heads"])
        return cls(**data)


def new_offer_uuid() -> int:
    """An offer's id: 63 random bits (the transfer server takes a 64-bit int)."""
    return secrets.randbits(63) or 1


def _start_transfer_server():
    client = jax.devices()[0].client
    return jax_transfer.start_transfer_server(client, "127.0.0.1:0",
                                              ["127.0.0.1:0"] * TRANSPORT_ADDRESSES)


class KVSender:
    """Prefill side: offers staged pages and holds them until released or the lease ends."""

    def __init__(self, inst: PoolInstance, lease_s: float = 60.0, control_port: int = 0,
                 secret: str | None = None):
        self.source = KVSource(inst)
        self.lease_s = lease_s
        self.compat = compat_hash(inst)
        self._server = _start_transfer_server()
        self._control = ControlServer({"release": self._on_release}, port=control_port,
                                      secret=secret)
        self._held: dict[int, tuple[list[jax.Array], float]] = {}
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="kv-lease")
        self._reaper.start()

    @property
    def control_address(self) -> str:
        return self._control.address

    def extract(self, layers: range, src_blocks, request_id: str = "") -> list[KVOffer]:
        """Stages and offers the pages, one offer per run of `page_runs` (exact bytes);
        never blocks on the prefill compute."""
        offers = []
        for offset, count in page_runs(len(src_blocks), self.source.inst.max_pages):
            staged, nbytes = self.source.stage(layers, src_blocks[offset:offset + count])
            pieces = self.source.pieces(staged)
            uuid = new_offer_uuid()
            arrays = [p.data for p in pieces]
            self._server.await_pull(uuid, arrays)
            with self._lock:
                self._held[uuid] = (arrays, time.monotonic() + self.lease_s)
            offers.append(KVOffer(
                request_id, uuid, self._server.address(), self.control_address, self.compat,
                (layers.start, layers.stop), count, nbytes, np.dtype(staged.dtype).name,
                tuple(tuple(a.shape) for a in arrays), tuple(p.heads for p in pieces), offset))
        return offers

    def drop_offers(self) -> None:
        """Forgets every offer at once (fault injection: the data is gone)."""
        with self._released:
            self._held.clear()
            self._released.notify_all()
        self._server = _start_transfer_server()  # a new server: old uuids are never served

    def held(self) -> int:
        """Offers still held (neither released nor expired)."""
        with self._lock:
            return len(self._held)

    def wait_released(self, timeout: float) -> bool:
        """Waits until no offer is held (all pulled and released, or expired); False on
        timeout."""
        with self._released:
            return self._released.wait_for(lambda: not self._held, timeout)

    def _on_release(self, msg: dict) -> dict:
        with self._released:
            released = self._held.pop(int(msg["uuid"]), None) is not None
            self._released.notify_all()
        return {"released": released}

    def _reap_loop(self) -> None:
        while not self._stop.wait(min(0.25, self.lease_s / 4)):
            now = time.monotonic()
            with self._released:
                for uuid in [u for u, (_, expiry) in self._held.items() if expiry <= now]:
                    del self._held[uuid]  # the receiver never came: drop our references
                    self._released.notify_all()

    def close(self) -> None:
        self._stop.set()
        self._reaper.join(timeout=2)
        self._control.stop()
        with self._released:
            self._held.clear()
            self._released.notify_all()


class KVReceiver:
    """Decode side: pulls offers under a watchdog and lands them in the pool."""

    def __init__(self, inst: PoolInstance, pull_timeout_s: float = 30.0,
                 secret: str | None = None):
        self.sink = KVSink(inst)
        self.control = ControlClients(secret)  # one channel per sender, for releases
        self.inst = inst
        self.pull_timeout_s = pull_timeout_s
        self.compat = compat_hash(inst)
        self._server = _start_transfer_server()
        self._connections = {}
        self._lock = threading.Lock()  # pulls may run on several threads

    def _connection(self, address: str):
        with self._lock:
            if address not in self._connections:
                self._connections[address] = self._server.connect(address)
            return self._connections[address]

    def _targets(self, offer: KVOffer) -> list:
        """For each piece, the first of our devices that needs its heads."""
        shape = list(offer.shapes[0])
        shape[HEAD_AXIS] = self.inst.config.num_kv_heads
        r = self.inst.kv_replication
        index_map = self.sink._sharding.addressable_devices_indices_map(tuple(shape))
        targets = []
        for heads in offer.heads:
            device = next((d for d, idx in index_map.items()
                           if set(e // r for e in range(*idx[HEAD_AXIS].indices(shape[HEAD_AXIS])))
                           & set(heads)), self.inst.devices[0])
            targets.append(device)
        return targets

    def pull(self, offer: KVOffer) -> InFlightKV:
        """Pulls one offer onto our devices (checked, under the watchdog)."""
        if offer.compat != self.compat:
            raise KVTransferError(
                f"request {offer.request_id!r}: incompatible KV (sender {offer.compat}, "
                f"receiver {self.compat}): the pools serve different models, dtypes or "
                "block layouts; nothing was pulled")
        specs = [jax.ShapeDtypeStruct(shape, np.dtype(offer.dtype),
                                      sharding=SingleDeviceSharding(device))
                 for shape, device in zip(offer.shapes, self._targets(offer), strict=True)]
        result: dict = {}

        def run():
            try:
                arrays = self._connection(offer.transfer_address).pull(offer.uuid, specs)
                result["arrays"] = jax.block_until_ready(arrays)
            except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
                result["error"] = e

        worker = threading.Thread(target=run, daemon=True, name=f"kv-pull-{offer.uuid}")
        worker.start()
        worker.join(self.pull_timeout_s)
        if worker.is_alive():
            # The pull cannot be cancelled; the thread is abandoned (daemon) and the
            # request fails now instead of hanging the decode loop.
            raise KVTransferError(
                f"request {offer.request_id!r}: pull of offer {offer.uuid} from "
                f"{offer.transfer_address} did not finish within {self.pull_timeout_s}s "
                "(sender gone, or the offer was never made or already consumed)")
        if "error" in result:
            raise KVTransferError(f"request {offer.request_id!r}: pull of offer {offer.uuid} "
                                  f"failed: {result['error']}") from result["error"]
        pieces = [Piece(a, h) for a, h in zip(result["arrays"], offer.heads, strict=True)]
        return InFlightKV(range(*offer.layers), self.sink.assemble(pieces), offer.num_pages,
                          offer.nbytes, offset=offer.offset)

    def insert(self, offers: list[KVOffer], dst_blocks) -> TransferStats:
        """Pulls every offer, scatters the pages into the pool, then releases the offers.

        transfer_s runs from the first pull to the pages in the pool (the prefill
        side's compute end is in another process, so exposed_s is left unset).
        """
        start = time.perf_counter()
        parts = [self.pull(offer) for offer in offers]
        self.sink.insert(parts, dst_blocks)
        jax.block_until_ready(self.inst.kv)
        stats = TransferStats(sum(p.nbytes for p in parts), time.perf_counter() - start)
        self.release(offers)
        return stats

    def release(self, offers: list[KVOffer]) -> None:
        """Tells the senders they may drop these offers (pulled or not)."""
        for offer in offers:
            try:
                self.control.get(offer.control_address).call(
                    "release", {"uuid": offer.uuid}, timeout=5.0)
            except Exception:  # noqa: BLE001 - the sender's lease frees it anyway
                pass

    def close(self) -> None:
        self.control.close()
