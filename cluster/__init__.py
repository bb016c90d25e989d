"""The assembled product: the application's configuration (``config.py``, the YAML's ``args``,
parsed once), the Ray Serve application that binds the ingress to the replicas (``app.py``,
``serve run deploy/cluster.yaml``), and a launcher that runs it under ``serve run``
(``launch.py``, shared by the tests, the benchmarks and ``scripts/run.sh``)."""
