"""The migrations build exactly the schema the models describe, from one head."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine

import migrations
from core.database.tables import Base


def test_one_head():
    heads = ScriptDirectory.from_config(migrations.alembic_config()).get_heads()
    assert len(heads) == 1, heads


def test_models_and_migrations_agree(pg_url):
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()
