"""Seeded workloads and trace replays, shared by the simulator and the HTTP load generator.

Entry point: ``loadgen.registry.make_workload``; see ``loadgen/README.md``.
"""
