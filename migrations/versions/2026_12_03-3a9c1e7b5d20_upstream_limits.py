"""upstream models: the shared in-flight limit and each dispatch worker's report

Revision ID: 3a9c1e7b5d20
Revises: 8d3e5f1a2b7c
Create Date: 2026-12-03 11:30:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "3a9c1e7b5d20"
down_revision: str | Sequence[str] | None = "8d3e5f1a2b7c"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "upstream_limits",
        sa.Column("upstream", sa.String(length=255), nullable=False),
        sa.Column("limit", sa.Integer(), nullable=False),
        sa.Column("leader", sa.String(length=255), nullable=True),
        sa.Column("leader_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("upstream", name=op.f("pk_upstream_limits")),
    )
    op.create_table(
        "upstream_members",
        sa.Column("upstream", sa.String(length=255), nullable=False),
        sa.Column("member", sa.String(length=255), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("demand", sa.Integer(), nullable=False),
        sa.Column("completed", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("latency_s", sa.Float(), nullable=False),
        sa.Column("busy_s", sa.Float(), nullable=False),
        sa.Column("overloads", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("upstream", "member", name=op.f("pk_upstream_members")),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_table("upstream_members")
    op.drop_table("upstream_limits")
