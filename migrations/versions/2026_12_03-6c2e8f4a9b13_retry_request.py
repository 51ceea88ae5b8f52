"""a keyed retry's request, compared when its idempotency key comes again

Revision ID: 6c2e8f4a9b13
Revises: 3a9c1e7d5b20
Create Date: 2026-12-03 15:00:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "6c2e8f4a9b13"
down_revision: str | Sequence[str] | None = "3a9c1e7d5b20"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column("batches", sa.Column("retry_request", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_column("batches", "retry_request")
