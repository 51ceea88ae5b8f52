"""Anthropic message batches, and OpenAI uploads with their parts

Revision ID: 3a9c1e7d5b20
Revises: 3a9c1e7b5d20
Create Date: 2026-12-03 11:50:00.000000

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "3a9c1e7d5b20"
down_revision: str | Sequence[str] | None = "3a9c1e7b5d20"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "message_batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        sa.Column("custom_ids", sa.JSON(), nullable=False),
        sa.Column("unservable", sa.JSON(), nullable=False),
        sa.Column("counts", sa.JSON(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("cancel_initiated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
            name=op.f("fk_message_batches_batch_id_batches"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_message_batches")),
    )
    op.create_index(op.f("ix_message_batches_tenant"), "message_batches", ["tenant"])
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("mime_type", sa.String(length=128), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("file_id", sa.String(length=64), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_uploads")),
    )
    op.create_index(op.f("ix_uploads_tenant"), "uploads", ["tenant"])
    op.create_index(op.f("ix_uploads_expires_at"), "uploads", ["expires_at"])
    op.create_table(
        "upload_parts",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("upload_id", sa.String(length=64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("storage_key", sa.String(length=512), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["upload_id"],
            ["uploads.id"],
            name=op.f("fk_upload_parts_upload_id_uploads"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_upload_parts")),
    )
    op.create_index(op.f("ix_upload_parts_upload_id"), "upload_parts", ["upload_id"])


def downgrade() -> None:
    """Downgrade schema."""
    op.drop_index(op.f("ix_upload_parts_upload_id"), table_name="upload_parts")
    op.drop_table("upload_parts")
    op.drop_index(op.f("ix_uploads_expires_at"), table_name="uploads")
    op.drop_index(op.f("ix_uploads_tenant"), table_name="uploads")
    op.drop_table("uploads")
    op.drop_index(op.f("ix_message_batches_tenant"), table_name="message_batches")
    op.drop_table("message_batches")
