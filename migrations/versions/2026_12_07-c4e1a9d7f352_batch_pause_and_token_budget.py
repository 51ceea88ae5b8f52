"""batches: paused (since when, seconds paused before) and a token budget

Revision ID: c4e1a9d7f352
Revises: b7d2e4f6a813
Create Date: 2026-12-07 06:10:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "c4e1a9d7f352"
down_revision: str | Sequence[str] | None = "b7d2e4f6a813"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("paused_s", sa.Float(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("max_total_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("max_total_tokens")
        batch_op.drop_column("paused_s")
        batch_op.drop_column("paused_at")
