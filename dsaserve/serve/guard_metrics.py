"""Prometheus series of the server's guards (dsaserve's own; vLLM has no such series): requests
aborted because their client stopped reading, and the shutdown drain. Registered on the app's
ServerMetrics registry and read at scrape time, like the engine's stats."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "dsaserve:"


class GuardCollector(Collector):
    """Counters and gauges read from callables (the owners keep plain ints: no lock, no registry
    in the engine bridge)."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._series: list[tuple[str, str, bool, Callable[[], float]]] = []

    def counter(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self._series.append((name, doc, True, read))

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self._series.append((name, doc, False, read))

    def collect(self) -> Iterator[Metric]:
        for name, doc, is_counter, read in self._series:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
                PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(read()))
            yield family
