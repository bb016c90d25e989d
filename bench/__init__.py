"""Benchmarks and experiment drivers, kept out of the product packages: cluster benchmarks over
HTTP (``cluster.py``), router overhead (``overhead.py``), decision-time micro-benchmarks
(``decision.py``, ``routing.py``) and policy-variant scoring (``score.py``). They may import any
product package; no product package imports them."""
