"""Metrics: the stats the serving processes record (``stats.py``, plain counters and histograms)
and their Prometheus exporter with cluster-wide scrape discovery (``exporter.py``). The serving
hosts (ingress, request router, replicas) record into it; ``dashboards`` reads its metric names."""
