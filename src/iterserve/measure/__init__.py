"""What a run sends and what it measures, defined once for bench, sim, LLM and Prometheus.

- :mod:`~iterserve.measure.latency`: per-request timings -> TTFT, TPOT, ITL, E2E and
  queue time (vLLM's definitions), and ``RequestMetrics``, the offline ``LLM``'s record.
- :mod:`~iterserve.measure.summary`: latency statistics (mean / median / std /
  percentiles) and goodput against SLOs.
- :mod:`~iterserve.measure.workload` with :mod:`~iterserve.measure.arrivals`,
  :mod:`~iterserve.measure.lengths` and :mod:`~iterserve.measure.traces`: the one
  workload generator (arrival processes, length distributions, trace files, the
  shipped traces by name) that ``iterserve simulate`` and ``iterserve bench serve``
  both draw from; :mod:`~iterserve.measure.streams` gives each part its own seeded
  stream, so one seed gives one workload.

Nothing here imports torch, HTTP or a clock.
"""
