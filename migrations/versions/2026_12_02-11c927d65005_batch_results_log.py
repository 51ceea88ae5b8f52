"""the results log: committed result chunks and their line ids, in commit order

Revision ID: 11c927d65005
Revises: 07af6648b2b4
Create Date: 2026-12-02 07:10:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "11c927d65005"
down_revision: str | Sequence[str] | None = "07af6648b2b4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.add_column(
        "batches",
        sa.Column("results_logged", sa.Integer(), server_default="0", nullable=False),
    )
    op.create_table(
        "result_chunks",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("first_seq", sa.Integer(), nullable=False),
        sa.Column("num_lines", sa.Integer(), nullable=False),
        sa.Column("storage_key", sa.String(length=512), nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
            name=op.f("fk_result_chunks_batch_id_batches"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("batch_id", "first_seq", name=op.f("pk_result_chunks")),
    )
    op.create_table(
        "result_lines",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("line_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
            name=op.f("fk_result_lines_batch_id_batches"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("batch_id", "line_id", name=op.f("pk_result_lines")),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table("result_lines")
    op.drop_table("result_chunks")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_column("results_logged")
