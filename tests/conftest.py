"""Test-session settings: under CI, hypothesis runs a fixed, reproducible set of examples."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
