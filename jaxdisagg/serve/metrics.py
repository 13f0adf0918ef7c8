"""Prometheus metrics of an engine (prometheus-client, on its own registry).

Latency histograms are fed as requests finish (the engine's finish listener); pool
gauges (queues, slots, KV blocks, prefix hits, transfer bytes) are read from
`Engine.metrics()` at scrape time, so they are never stale and cost nothing between
scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

# Seconds: from a few ms (tiny model on CPU, decode on a GPU) to minutes (long prompts on CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _PoolGauges:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        metrics = self.engine.metrics()
        families: dict[str, GaugeMetricFamily] = {}
        for pool, gauges in metrics["pools"].items():
            for key, value in gauges.items():
                name = f"jaxdisagg_pool_{key}"
                if name not in families:
                    families[name] = GaugeMetricFamily(name, key.replace("_", " "),
                                                       labels=["pool"])
                families[name].add_metric([pool], float(value))
        yield from families.values()
        yield GaugeMetricFamily("jaxdisagg_requests_in_flight", "requests in flight",
                                value=metrics["in_flight"])


class PrometheusExporter:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("jaxdisagg_ttft_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxdisagg_inter_token_seconds", "time between tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxdisagg_e2e_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("jaxdisagg_requests", "finished requests", ["finish_reason"],
                                registry=r)
        self.tokens = Counter("jaxdisagg_generated_tokens", "generated tokens", registry=r)
        self.cached = Counter("jaxdisagg_prefix_cached_tokens",
                              "prompt tokens served from the prefix cache", registry=r)
        self.transfer = Counter("jaxdisagg_transfer_bytes", "KV bytes moved between pools",
                                registry=r)
        self.transfer_time = Histogram(
            "jaxdisagg_transfer_seconds", "first KV leaving the prefill pool -> all landed",
            buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_failures = Counter(
            "jaxdisagg_transfer_failures", "requests failed while their KV was moving",
            registry=r)
        r.register(_PoolGauges(engine))
        engine.add_finish_listener(self.observe)
        self._httpd = None

    def observe(self, result) -> None:
        if result.ttft_s is not None:
            self.ttft.observe(result.ttft_s)
        for gap in result.tbt_s:
            self.itl.observe(gap)
        if result.e2e_s is not None:
            self.e2e.observe(result.e2e_s)
        self.requests.labels(result.finish_reason.split(":")[0]).inc()
        self.tokens.inc(len(result.token_ids))
        self.cached.inc(result.cached_tokens)
        self.transfer.inc(result.transfer_bytes)
        t = result.timeline
        if "transfer_start" in t and "transfer_end" in t:
            self.transfer_time.observe(max(0.0, t["transfer_end"] - t["transfer_start"]))
        if "transfer_failed" in t or (result.finish_reason.startswith("error")
                                      and "transfer_start" in t and "transfer_end" not in t):
            self.transfer_failures.inc()

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics over HTTP; returns the bound port (port 0 picks a free one)."""
        self._httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._httpd.server_port

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
