"""batch output_expires_after

Revision ID: 0f4d6855057f
Revises: 352a639198e5
Create Date: 2026-12-01 02:50:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0f4d6855057f"
down_revision: str | Sequence[str] | None = "352a639198e5"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column("batches", sa.Column("output_expires_after_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column("batches", "output_expires_after_s")
