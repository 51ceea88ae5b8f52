"""a batch's streamed validation: whether it is done, and when it last made progress

Revision ID: 8d3e5f1a2b7c
Revises: 5be0d7c2a1f4
Create Date: 2026-12-02 10:30:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "8d3e5f1a2b7c"
down_revision: str | Sequence[str] | None = "5be0d7c2a1f4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column(
        "batches",
        sa.Column("validation_done", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.add_column("batches", sa.Column("validated_at", sa.DateTime(timezone=True), nullable=True))
    # Every batch past validating was validated whole before this revision.
    op.execute("UPDATE batches SET validation_done = true WHERE status <> 'validating'")


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column("batches", "validated_at")
    op.drop_column("batches", "validation_done")
