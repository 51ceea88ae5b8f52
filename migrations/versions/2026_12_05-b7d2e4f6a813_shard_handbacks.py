"""shards: hand-backs of a draining worker counted apart from failed attempts

Revision ID: b7d2e4f6a813
Revises: 9e41b7c3d2a6
Create Date: 2026-12-05 10:00:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "b7d2e4f6a813"
down_revision: str | Sequence[str] | None = "9e41b7c3d2a6"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("handbacks", sa.Integer(), server_default="0", nullable=False)
        )


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.drop_column("handbacks")
