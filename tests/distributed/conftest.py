"""The test files collected, for the shared torchrun launch (cases.shared): it runs only their cases."""

from tests.distributed import cases


def pytest_collection_finish(session):
    cases.COLLECTED = {str(item.path.resolve()) for item in session.items}
