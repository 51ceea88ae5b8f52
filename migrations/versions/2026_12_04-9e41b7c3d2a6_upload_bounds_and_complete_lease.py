"""uploads: parts counted and summed on the row, a complete's claim with a lease

Revision ID: 9e41b7c3d2a6
Revises: 6c2e8f4a9b13
Create Date: 2026-12-04 10:00:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "9e41b7c3d2a6"
down_revision: str | Sequence[str] | None = "6c2e8f4a9b13"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table("uploads", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("part_count", sa.Integer(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("received_bytes", sa.BigInteger(), server_default="0", nullable=False)
        )
        batch_op.add_column(
            sa.Column("completing_since", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.create_index(batch_op.f("ix_uploads_status"), ["status"], unique=False)
    # The parts already recorded count towards their upload's bounds.
    op.execute(
        "UPDATE uploads SET "
        "part_count = (SELECT count(*) FROM upload_parts WHERE upload_id = uploads.id), "
        "received_bytes = (SELECT coalesce(sum(bytes), 0) FROM upload_parts "
        "WHERE upload_id = uploads.id)"
    )
    # An upload left completing by an earlier release has no claim time: its lease starts now,
    # so a complete still running through the upgrade is not taken over at once.
    op.execute(
        "UPDATE uploads SET completing_since = CURRENT_TIMESTAMP WHERE status = 'completing'"
    )


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table("uploads", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_uploads_status"))
        batch_op.drop_column("completing_since")
        batch_op.drop_column("received_bytes")
        batch_op.drop_column("part_count")
