"""Every test under tests/e2e/ is an end-to-end test (``e2e`` marker), whether or not its module
says so: ``scripts/test_fast.sh`` deselects them."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
