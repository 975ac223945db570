import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Four tiny drafters (EAGLE-3, MTP, DFlash, DSpark) trained once per run (tests/drafter_setup.py)."""
    from tests.drafter_setup import train_all

    return train_all(tmp_path_factory.mktemp("drafters"))
