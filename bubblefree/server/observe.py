"""What the server reports: ``/v1/stats`` as JSON and ``/metrics`` for
Prometheus, from one set of counters.

Each app has its own registry, so two apps in one process (tests, or two
engines) never share or collide on counters. Engine gauges are read when
scraped; the decode thread owns those structures, but reading an int from
another thread is safe in CPython and a scrape tolerates a value one tick old.
"""

from __future__ import annotations

import collections
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily

from bubblefree.engine import Engine
from bubblefree.server.admission import Admission

ROUTES = ("/health", "/metrics", "/v1/stats", "/v1/models", "/v1/caption", "/v1/query", "/v1/point",
          "/v1/detect", "/v1/segment", "/v1/chat/completions", "/v1/completions")


class Observer:
    def __init__(self, engine: Engine, admission: Admission):
        self.engine, self.admission = engine, admission
        self.by_status: collections.Counter = collections.Counter()
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("bubblefree_http_requests", "HTTP requests answered, by route and status",
                                 ("route", "status"), registry=self.registry)
        self._tokens = Counter("bubblefree_tokens", "Tokens, by kind (prompt, completion)", ("kind",),
                               registry=self.registry)
        # A stream's status goes out with its first bytes: whether its client
        # read it to the end is told only here.
        self.streams: collections.Counter = collections.Counter()
        self._streams = Counter("bubblefree_streams_ended", "Streamed answers, by how they ended "
                                "(finished, client_left, deadline, shutdown, error)", ("how",),
                                registry=self.registry)
        gauges = {"bubblefree_live_requests": ("Requests admitted and not ended", lambda: admission.live),
                  "bubblefree_queue_depth": ("Requests waiting for KV pages or a row slot",
                                             lambda: len(self._scheduler.queue)),
                  "bubblefree_kv_pages_free": ("Free KV cache pages", lambda: self._scheduler.pages.num_free),
                  "bubblefree_kv_pages_total": ("KV cache pages", lambda: self._scheduler.pages.size)}
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=self.registry).set_function(read)
        self.registry.register(_AutoTicks(engine))

    @property
    def _scheduler(self) -> Any:
        return self.engine.core.scheduler

    def answered(self, path: str, status: int) -> None:
        self.by_status[status] += 1
        self._requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def stream_ended(self, how: str) -> None:
        self.streams[how] += 1
        self._streams.labels(how).inc()

    def tokens(self, prompt: int, completion: int) -> None:
        self._tokens.labels("prompt").inc(prompt)
        self._tokens.labels("completion").inc(completion)

    def stats(self) -> dict[str, Any]:
        s = self._scheduler
        return {"requests_by_status": {str(k): v for k, v in sorted(self.by_status.items())},
                "streams_ended": dict(sorted(self.streams.items())),
                "live_requests": self.admission.live, "max_live_requests": self.admission.limit,
                "queue_depth": len(s.queue),
                "kv_pages": {"free": s.pages.num_free, "total": s.pages.size},
                "row_slots": {"free": s.rows.num_free, "total": s.rows.size},
                "pipelined": self.engine.pipelined, "auto_ticks": _auto_ticks(self.engine)}

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)


def _auto_ticks(engine: Engine) -> dict[str, int]:
    core = engine.core
    return {"ahead": core.ahead_ticks, "behind": core.behind_ticks, "unweighed": core.unweighed_ticks}


class _AutoTicks:
    """``bubblefree_auto_ticks_total{choice}``: the ticks ``pipelined="auto"``
    left its step in flight (ahead) or committed it at once (behind), or
    left it in flight without weighing the rule (unweighed), read from the
    engine when scraped."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list:
        return [CounterMetricFamily("bubblefree_auto_ticks", _AUTO_DOC, labels=("choice",))]

    def collect(self) -> list:
        family = CounterMetricFamily("bubblefree_auto_ticks", _AUTO_DOC, labels=("choice",))
        for choice, n in _auto_ticks(self.engine).items():
            family.add_metric((choice,), n)
        return [family]


_AUTO_DOC = ("Ticks of the auto mode, by its choice: the next step launched ahead of the commit, or behind it, "
             "or ahead without weighing (unweighed: choosing was not worth its host time)")
