"""api key max priority, ui sessions, when a webhook's next attempt is due

Revision ID: 07af6648b2b4
Revises: 0f4d6855057f
Create Date: 2026-12-02 03:37:18.592631

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "07af6648b2b4"
down_revision: str | Sequence[str] | None = "0f4d6855057f"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    # Existing keys get "normal": "high" becomes an entitlement an administrator grants.
    op.add_column(
        "api_keys",
        sa.Column("max_priority", sa.String(length=8), server_default="normal", nullable=False),
    )
    op.create_table(
        "ui_sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ui_sessions")),
    )
    op.create_index(op.f("ix_ui_sessions_expires_at"), "ui_sessions", ["expires_at"], unique=False)
    # When a webhook delivery's next attempt is due, so that the sweep can send again one
    # whose attempt was lost; the rows recorded before it are due since their creation.
    op.add_column(
        "webhook_deliveries",
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.execute("UPDATE webhook_deliveries SET next_attempt_at = created_at")
    op.create_index(
        "ix_webhook_deliveries_due",
        "webhook_deliveries",
        ["next_attempt_at"],
        unique=False,
        postgresql_where=sa.text("status = 'pending'"),
        sqlite_where=sa.text("status = 'pending'"),
    )


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.drop_column("next_attempt_at")
    op.drop_index(op.f("ix_ui_sessions_expires_at"), table_name="ui_sessions")
    op.drop_table("ui_sessions")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("max_priority")
