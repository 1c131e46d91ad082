"""long tail: token-weighted versions, staleness and resumes per episode

Episodes gain `version_sum` (the sum of the policy versions of their model tokens, so that
staleness can be counted per token, not by the oldest token), `staleness` (recorded when
trained) and `resumes` (times a serve resumed it after its serve died); groups gain
`token_version` (their stalest episode's token-weighted version); episodes get an index on
`finished_at` (the stats window sorts on it).
Rows written before this revision carry no per-token sum: they are given their oldest version
for every token, which is what staleness counted for them until now.

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
        batch_op.add_column(sa.Column('version_sum', sa.BigInteger(), nullable=False,
                                      server_default='0'))
        batch_op.add_column(sa.Column('staleness', sa.Double(), nullable=True))
        batch_op.add_column(sa.Column('resumes', sa.Integer(), nullable=False,
                                      server_default='0'))
        batch_op.create_index('ix_episodes_finished', ['finished_at'], unique=False)

    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.add_column(sa.Column('token_version', sa.Double(), nullable=True))

    op.execute("UPDATE episodes SET version_sum = COALESCE(min_version, 0) * num_model_tokens")
    op.execute("UPDATE groups SET token_version = min_version")


def downgrade() -> None:
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.drop_column('token_version')

    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.drop_index('ix_episodes_finished')
        batch_op.drop_column('resumes')
        batch_op.drop_column('staleness')
        batch_op.drop_column('version_sum')
