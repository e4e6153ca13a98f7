"""The integration tests' own database, beside the e2e tests' one on the same server."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import migrated_database


@pytest.fixture(scope="session")
def database_url(postgres_server: Any) -> str:
    """A migrated database of the integration tests alone.

    Their store tests commit outbox rows for topics no broker has, and nothing here publishes
    them. In the e2e tests' database a job's publisher would retry those rows for ever and hold
    up its own behind them: whether an e2e test passed would depend on which tests ran before.
    """
    return migrated_database(postgres_server, "_integration")
