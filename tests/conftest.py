import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from dist_harness import close_all  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    close_all()
