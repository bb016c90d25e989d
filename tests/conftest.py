"""Test-session settings: under CI, hypothesis runs a fixed, reproducible set of examples; and
no test outside tests/e2e may start or join a Ray cluster.

Why the second: CI runs the tests outside tests/e2e beside the cluster tests (scripts/test.sh).
A Ray call that initializes Ray on its own (an actor's ``.remote()``, ``ray.get``) joins the
cluster test's running cluster, and when that cluster stops the test process exits with status 1
a minute later, with no report."""

import os
import sys

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _no_ray_outside_e2e(request: pytest.FixtureRequest):
    yield
    ray = sys.modules.get("ray")
    if ray is None or request.node.get_closest_marker("e2e") is not None or not ray.is_initialized():
        return
    ray.shutdown()
    pytest.fail("this test started or joined a Ray cluster: only the tests under tests/e2e may "
                "(tests/conftest.py says why)")
