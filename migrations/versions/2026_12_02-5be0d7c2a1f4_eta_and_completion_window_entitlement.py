"""a batch's projected completion and at-risk mark; a key's shortest completion window

Revision ID: 5be0d7c2a1f4
Revises: 11c927d65005
Create Date: 2026-12-02 08:30:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "5be0d7c2a1f4"
down_revision: str | Sequence[str] | None = "11c927d65005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column(
        "batches",
        sa.Column("estimated_completion_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.add_column(
        "batches",
        sa.Column("at_risk", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    # Existing keys keep every window the server accepts.
    op.add_column("api_keys", sa.Column("min_completion_window_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column("api_keys", "min_completion_window_s")
    op.drop_column("batches", "at_risk")
    op.drop_column("batches", "estimated_completion_at")
