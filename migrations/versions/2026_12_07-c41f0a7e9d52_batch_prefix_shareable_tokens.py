"""batches: the prompt tokens the prefix plan predicts a prefix cache can serve

Revision ID: c41f0a7e9d52
Revises: c4e1a9d7f352
Create Date: 2026-12-07 06:30:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "c41f0a7e9d52"
down_revision: str | Sequence[str] | None = "c4e1a9d7f352"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "prefix_shareable_tokens", sa.BigInteger(), server_default="0", nullable=False
            )
        )


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("prefix_shareable_tokens")
