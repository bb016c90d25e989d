"""The HTTP load generator: replays a workload (``workloads``) against a running cluster over its
OpenAI-compatible API, with streaming, and writes the simulator's summary schema.

Entry point: ``python -m loadgen run``; see ``loadgen/README.md``.
"""
