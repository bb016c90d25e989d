"""Grafana dashboards as code (queries.py, build.py), PNG rendering (render.py), a synthetic demo."""
