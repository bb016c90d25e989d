"""Seeded workloads and trace replays, shared by the simulator (``sim``) and the HTTP load
generator (``loadgen``), so both replay the very same requests.

Entry point: ``workloads.registry.make_workload``; see ``loadgen/README.md``.
"""
