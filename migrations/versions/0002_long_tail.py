"""long tail: staleness per trained episode, resumes, the groups' newest-token version

Episodes gain `staleness` (recorded when trained: the trainer's version before the step minus
the mean version of the tokens it trained) and `resumes` (times a serve resumed it after its
serve died); groups gain `newest_version` (the lowest newest-token version among their
completed episodes, what the staleness floor is compared with now that it bounds tokens);
episodes get an index on `finished_at` (the stats window sorts on it). Groups decided before
this revision get their `newest_version` from their episodes.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 11:50:28.893167
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('staleness', sa.Double(), nullable=True))
        batch_op.add_column(sa.Column('resumes', sa.Integer(), nullable=False,
                                      server_default='0'))
        batch_op.create_index('ix_episodes_finished', ['finished_at'], unique=False)

    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.add_column(sa.Column('newest_version', sa.Integer(), nullable=True))

    op.execute(
        "UPDATE groups SET newest_version = (SELECT MIN(e.max_version) FROM episodes e "
        "WHERE e.group_id = groups.id AND e.status IN ('completed', 'trained', 'filtered'))"
    )


def downgrade() -> None:
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.drop_column('newest_version')

    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.drop_index('ix_episodes_finished')
        batch_op.drop_column('resumes')
        batch_op.drop_column('staleness')
