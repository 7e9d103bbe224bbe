"""The server's Prometheus metrics under vLLM's family names (GET /metrics, Prometheus text format), in a
registry of the server's own (two servers in one process never share counts):

- gauges read at each scrape from the engine's scheduler: `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0..1), and the counter `vllm:num_preemptions`;
- counted as each request's outputs pass through the server: `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`, and the histograms
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds` (the gaps between a request's
  outputs, per token) and `vllm:e2e_request_latency_seconds`. A request answered in one piece (no stream)
  has no first-token or inter-token time to observe here. A request's per-token counts gather in its meter and
  reach Prometheus at most every half second and at its end (RequestMetrics).

With several API-server processes (`--api-server-count N`) each counts its own requests, and /metrics, whichever
process answers, reports the whole server: as vLLM, prometheus_client's multiprocess mode (each process writes its
counts to files in PROMETHEUS_MULTIPROC_DIR, set before it imports prometheus_client, api_servers.py; a scrape
sums them). The gauges and the preemptions are the engine core's numbers, the same in every API server (core.py
sends them to each when they change): read, not summed. `minivllm:api_server_requests` counts the requests each
API-server process took (with several, one series per process, labelled with its pid)."""

import os
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minivllm.frontend.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class CoreGauges:
    """The engine core's gauges and preemption count, read at each scrape (a custom collector)."""

    def __init__(self, llm, model_name: str) -> None:
        self.llm, self.model_name = llm, model_name

    def collect(self):
        stats = self.llm.stats
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", stats.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily("vllm:num_preemptions", "Preempted sequences.", labels=["model_name"])
        family.add_metric([self.model_name], stats.num_preemptions)
        yield family


class ServerMetrics:
    def __init__(self, llm, model_name: str) -> None:
        self.registry = CollectorRegistry()  # this process's metrics (multiprocess mode: also in the files)
        self.view = self.registry  # what a scrape renders
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:  # several API servers: every process's counts, summed
            self.view = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.view)
        self.view.register(CoreGauges(llm, model_name))
        label = dict(model_name=model_name)
        reg = dict(labelnames=["model_name"], registry=self.registry)
        self.requests = Gauge(  # (multiprocess mode "all": a series per process, labelled with its pid)
            "minivllm:api_server_requests",
            "Requests this API-server process took.",
            multiprocess_mode="all",
            registry=self.registry,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests.", **reg).labels(**label)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", **reg).labels(**label)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        hist = lambda name, doc, buckets: Histogram(name, doc, buckets=buckets, **reg).labels(**label)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", E2E_BUCKETS)
        self.itl_bounds = (*ITL_BUCKETS, float("inf"))  # the histogram's buckets, +Inf last
        if tuple(getattr(self.itl, "_upper_bounds", ())) != self.itl_bounds:  # (observe_many's assumption)
            raise RuntimeError("prometheus_client's Histogram no longer keeps _upper_bounds, _buckets and _sum")

    @staticmethod
    def observe_many(histogram, counts: list[int], total: float) -> None:
        """`histogram.observe` of many values at once: `counts[i]` of them in bucket i (Histogram's own layout:
        a value per bucket, not cumulative, and their sum), one change per bucket instead of one per value."""
        histogram._sum.inc(total)
        for bucket, count in zip(histogram._buckets, counts):
            if count:
                bucket.inc(count)

    def render(self) -> bytes:
        return generate_latest(self.view)

    def request(self, streaming: bool) -> "RequestMetrics":
        """A request's meter: call it with each of its outputs as it passes (the latencies only of a streamed
        request, whose outputs come as the tokens do)."""
        return RequestMetrics(self, streaming)


class RequestMetrics:
    """One request's counts and latencies, fed each output (`meter(output)`) and closed at the stream's end
    (`meter.close()`). The per-token counts (generation tokens, inter-token gaps) gather here and reach
    Prometheus at most every FLUSH_S seconds and at the end: a Prometheus value takes a lock (and, with several
    API servers, writes its file) on every change, which would otherwise happen for every output of every stream."""

    __slots__ = ("server", "streaming", "start", "last", "first", "done", "tokens", "gaps", "gap_sum", "flushed")

    FLUSH_S = 0.5

    def __init__(self, server: ServerMetrics, streaming: bool) -> None:
        self.server, self.streaming = server, streaming
        self.start = self.flushed = time.monotonic()
        self.last: float | None = None  # when the last output with tokens came
        self.first = True
        self.done: set[int] = set()  # the sequences whose finish is counted
        self.tokens = 0  # generation tokens not yet counted in Prometheus
        self.gaps = [0] * len(server.itl_bounds)  # inter-token gaps not yet observed, per bucket
        self.gap_sum = 0.0

    def __call__(self, output: RequestOutput) -> None:
        m, now = self.server, time.monotonic()
        if self.first:
            m.requests.inc()
            m.prompt_tokens.inc(len(output.prompt_token_ids))
            self.first = False
        tokens = 0  # (one pass over the choices: this runs for every output of every stream)
        for c in output.outputs:
            tokens += len(c.token_ids)
            if c.finish_reason is not None and c.index not in self.done:
                self.done.add(c.index)
                m.success.labels(model_name=m.model_name, finished_reason=c.finish_reason).inc()
        if tokens:
            self.tokens += tokens
            if self.streaming:
                if self.last is None:
                    m.ttft.observe(now - self.start)
                else:
                    gap = (now - self.last) / tokens
                    self.gaps[bisect_left(m.itl_bounds, gap)] += 1  # (the histogram's bucket: gap <= its bound)
                    self.gap_sum += gap
                self.last = now
        if output.finished:
            self.flush(now)
            m.e2e.observe(now - self.start)
        elif now - self.flushed >= self.FLUSH_S:
            self.flush(now)

    def close(self) -> None:
        """The stream ended (finished, failed or left): what gathered reaches Prometheus."""
        self.flush(time.monotonic())

    def flush(self, now: float) -> None:
        m, self.flushed = self.server, now
        if self.tokens:
            m.generation_tokens.inc(self.tokens)
            self.tokens = 0
        if any(self.gaps):
            m.observe_many(m.itl, self.gaps, self.gap_sum)
            self.gaps, self.gap_sum = [0] * len(m.itl_bounds), 0.0
