"""turn segments: a rewritten conversation is a segment of its own

Turns gain `segment` (0, then one more each time an agent's conversation was rewritten
instead of extended, through the gateway): the trainer cuts an episode's token stream at its
segment starts and trains each segment as a sequence of its own, and the viewer marks where
one begins. Every turn written before this revision belongs to segment 0.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 18:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.add_column(sa.Column('segment', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.drop_column('segment')
