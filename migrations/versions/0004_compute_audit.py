"""compute audit and evaluation runs: timings, engine samples, the kind of a run

What `agent-rl audit` reads besides the episodes: `timings` (spans of wall-clock time the
trainer spent stepping, waiting for data, exporting and syncing weights, and evaluations' spans)
and `engine_samples` (each engine's running and queued requests, KV-cache use, generation
throughput and its counter of prompt tokens prefilled, sampled by serve from SGLang's `/v1/loads`). Runs gain `kind` (`train`, or `eval`
for an evaluation that no trainer consumes) and, for an evaluation, the run and policy version
it evaluated (`evaluates_run_id`, `evaluates_version`). Runs made before this revision are
`train` runs.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 14:45:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'timings',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('source', sa.String(length=200), nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('started_at', sa.Double(), nullable=False),
        sa.Column('finished_at', sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_timings_run', 'timings', ['run_id', 'started_at'], unique=False)
    op.create_table(
        'engine_samples',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('engine', sa.String(length=200), nullable=False),
        sa.Column('sampled_at', sa.Double(), nullable=False),
        sa.Column('running', sa.Integer(), nullable=False),
        sa.Column('waiting', sa.Integer(), nullable=False),
        sa.Column('token_usage', sa.Double(), nullable=True),
        sa.Column('gen_tokens_per_s', sa.Double(), nullable=True),
        sa.Column('prefill_tokens_total', sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_engine_samples_run', 'engine_samples', ['run_id', 'sampled_at'],
                    unique=False)
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('kind', sa.String(length=16), nullable=False,
                                      server_default='train'))
        batch_op.add_column(sa.Column('evaluates_run_id', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('evaluates_version', sa.Integer(), nullable=True))
        batch_op.create_index('ix_runs_evaluates', ['evaluates_run_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_evaluates')
        batch_op.drop_column('evaluates_version')
        batch_op.drop_column('evaluates_run_id')
        batch_op.drop_column('kind')
    op.drop_index('ix_engine_samples_run', table_name='engine_samples')
    op.drop_table('engine_samples')
    op.drop_index('ix_timings_run', table_name='timings')
    op.drop_table('timings')
