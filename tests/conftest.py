import gc
import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")


_PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _collect_dead_engines():  # noqa: ANN202
    """An engine is a reference cycle (its scheduler holds its bound methods), which Python's collector, counting
    objects rather than bytes, may leave for many tests: each dead SmolLM2 engine held ~0.6 GB until the suite
    peaked at 19 GB. Collect after a test once this process holds more than 1.5 GB."""
    yield
    with open("/proc/self/statm") as f:
        if int(f.read().split()[1]) * _PAGE > 1.5 * 2**30:
            gc.collect()


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Four tiny drafters (EAGLE-3, MTP, DFlash, DSpark) trained once per run (tests/drafter_setup.py)."""
    from tests.drafter_setup import train_all

    return train_all(tmp_path_factory.mktemp("drafters"))
