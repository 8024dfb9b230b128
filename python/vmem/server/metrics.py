"""``/metrics``: Prometheus text from prometheus-client, vLLM's metric names under a ``vmem:``
prefix, every series labelled ``model_name``.

Histograms (seconds): ``vmem:time_to_first_token_seconds``, ``vmem:inter_token_latency_seconds``,
``vmem:e2e_request_latency_seconds``. Counters: ``vmem:prompt_tokens_total``,
``vmem:generation_tokens_total``, ``vmem:request_success_total`` (by ``finished_reason``),
``vmem:request_rejected_total`` (429s), ``vmem:idle_sleeps_total``,
``vmem:num_preemptions_total``. Gauges read at each scrape: ``vmem:num_requests_running``
(requests holding KV), ``vmem:num_requests_waiting``, ``vmem:kv_cache_bytes`` (KV pages mapped),
``vmem:kv_cache_physical_bytes`` (pages made), ``vmem:kv_cache_budget_bytes``,
``vmem:kv_cache_usage_perc``, ``vmem:asleep``. The router adds the pool's, per tenant
(:func:`pool_families`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

#: Prometheus' text format, as prometheus-client writes it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so dashboards made for it read these.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineGauges:
    """The gauges read from the engine at each scrape (``snapshot()``: a dict, or ``None``
    before the engine's cache exists)."""

    def __init__(self, model: str, snapshot: Callable[[], Optional[Dict[str, Any]]]) -> None:
        self.model, self.snapshot = model, snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        if s is None:
            return
        labels = [self.model]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        yield gauge("vmem:num_requests_running", "Requests holding KV memory.", s["running"])
        yield gauge("vmem:num_requests_waiting", "Requests admitted and waiting for KV memory.", s["waiting"])
        yield gauge("vmem:kv_cache_bytes", "Bytes of KV pages mapped (a shared page once).", s["mapped"])
        yield gauge("vmem:kv_cache_physical_bytes", "Bytes of KV pages made (mapped, kept, cached prefixes).",
                    s["physical"])
        yield gauge("vmem:kv_cache_budget_bytes", "The KV cache's budget in bytes.", s["budget"])
        yield gauge("vmem:kv_cache_usage_perc", "KV pages mapped, as a share of the budget (0 to 1).",
                    s["mapped"] / s["budget"] if s["budget"] else 0.0)
        yield gauge("vmem:asleep", "1 while the model's KV memory is released (idle sleep).",
                    1.0 if s["asleep"] else 0.0)
        c = CounterMetricFamily("vmem:num_preemptions", "Requests preempted and admitted again.", labels=["model_name"])
        c.add_metric(labels, s["preemptions"])
        yield c


class Metrics:
    """One model's metrics in a registry of their own."""

    def __init__(self, model: str, snapshot: Callable[[], Optional[Dict[str, Any]]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        lab = ["model_name"]
        self.ttft = Histogram("vmem:time_to_first_token_seconds", "Time to the first token.", lab,
                              buckets=TTFT_BUCKETS, registry=r).labels(model)
        self.itl = Histogram("vmem:inter_token_latency_seconds", "Time between two tokens of a request.", lab,
                             buckets=ITL_BUCKETS, registry=r).labels(model)
        self.e2e = Histogram("vmem:e2e_request_latency_seconds", "Time from arrival to the last token.", lab,
                             buckets=E2E_BUCKETS, registry=r).labels(model)
        self.prompt_tokens = Counter("vmem:prompt_tokens", "Prompt tokens admitted.", lab, registry=r).labels(model)
        self.generation_tokens = Counter("vmem:generation_tokens", "Tokens generated.", lab, registry=r).labels(model)
        self._success = Counter("vmem:request_success", "Choices finished, by finish reason.",
                                lab + ["finished_reason"], registry=r)
        self.rejected = Counter("vmem:request_rejected", "Requests refused at the queue bound (429).", lab,
                                registry=r).labels(model)
        self.sleeps = Counter("vmem:idle_sleeps", "Times the model's KV memory was released while idle.", lab,
                              registry=r).labels(model)
        self.model = model
        r.register(_EngineGauges(model, snapshot))

    def finished(self, reason: str) -> None:
        """Counts a choice finished with ``reason`` (``stop``, ``length``, ``cancelled``)."""
        self._success.labels(self.model, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text of every metric."""
        return bytes(generate_latest(self.registry))


class Merged:
    """Collector of families parsed from other processes' ``/metrics`` (the router's workers)
    plus the router's own: same-named families become one."""

    def __init__(self, families: List[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        merged: Dict[str, Metric] = {}
        for f in self.families:
            into = merged.get(f.name)
            if into is None:
                merged[f.name] = f
            else:
                into.samples.extend(f.samples)
        yield from merged.values()


def parse(text: str) -> List[Metric]:
    """The families in a ``/metrics`` text."""
    return list(text_string_to_metric_families(text))


def render_families(families: List[Metric]) -> bytes:
    """Prometheus text of ``families`` (merged by name)."""
    r = CollectorRegistry(auto_describe=False)
    r.register(Merged(families))
    return bytes(generate_latest(r))


def pool_families(status: Any) -> List[Metric]:
    """The pool's gauges from a :class:`vmem.pool.PoolStatus`: its total and used bytes, each live
    tenant's usage and limit (labelled ``tenant``)."""
    total = GaugeMetricFamily("vmem:pool_total_bytes", "The KV pool's size in bytes.")
    total.add_metric([], status.total)
    used = GaugeMetricFamily("vmem:pool_used_bytes", "Bytes the pool's tenants hold.")
    used.add_metric([], status.used)
    usage = GaugeMetricFamily("vmem:pool_tenant_usage_bytes", "Bytes a pool tenant holds.", labels=["tenant"])
    limit = GaugeMetricFamily("vmem:pool_tenant_limit_bytes", "A pool tenant's limit in bytes.", labels=["tenant"])
    for t in status.tenants:
        usage.add_metric([t.name], t.usage)
        limit.add_metric([t.name], t.limit)
    return [total, used, usage, limit]
