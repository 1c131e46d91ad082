"""initial schema: runs, policy versions, tasks, groups, episodes, turns, messages, tool calls

Revision ID: 0001
Revises:
Create Date: 2026-11-30 08:02:27.991702
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('policy_versions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('checkpoint', sa.Text(), nullable=True),
    sa.Column('trainer_step', sa.Integer(), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=True),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('run_id', 'version')
    )
    op.create_table('tasks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('env_id', sa.String(length=200), nullable=False),
    sa.Column('key', sa.String(length=200), nullable=False),
    sa.Column('payload', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.create_index('ix_tasks_run_key', ['run_id', 'env_id', 'key'], unique=False)

    op.create_table('groups',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('task_id', sa.Integer(), nullable=False),
    sa.Column('env_id', sa.String(length=200), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('filter_reason', sa.Text(), nullable=True),
    sa.Column('min_version', sa.Integer(), nullable=True),
    sa.Column('claim_id', sa.String(length=64), nullable=True),
    sa.Column('claimed_by', sa.String(length=200), nullable=True),
    sa.Column('lease_expires_at', sa.Double(), nullable=True),
    sa.Column('trained_step', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('ready_at', sa.Double(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.create_index('ix_groups_run_status', ['run_id', 'status'], unique=False)

    op.create_table('episodes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('group_id', sa.Integer(), nullable=False),
    sa.Column('task_id', sa.Integer(), nullable=False),
    sa.Column('env_id', sa.String(length=200), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('seed', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reward', sa.Double(), nullable=True),
    sa.Column('reward_details', sa.JSON(), nullable=True),
    sa.Column('advantage', sa.Double(), nullable=True),
    sa.Column('num_turns', sa.Integer(), nullable=False),
    sa.Column('num_messages', sa.Integer(), nullable=False),
    sa.Column('num_tokens', sa.Integer(), nullable=False),
    sa.Column('num_model_tokens', sa.Integer(), nullable=False),
    sa.Column('min_version', sa.Integer(), nullable=True),
    sa.Column('max_version', sa.Integer(), nullable=True),
    sa.Column('drift_count', sa.Integer(), nullable=False),
    sa.Column('tool_error_count', sa.Integer(), nullable=False),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('heartbeat_at', sa.Double(), nullable=True),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('started_at', sa.Double(), nullable=True),
    sa.Column('finished_at', sa.Double(), nullable=True),
    sa.Column('filter_reason', sa.Text(), nullable=True),
    sa.Column('error_type', sa.String(length=100), nullable=True),
    sa.Column('error_cause', sa.Text(), nullable=True),
    sa.Column('trained_step', sa.Integer(), nullable=True),
    sa.Column('parent_episode_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['group_id'], ['groups.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['parent_episode_id'], ['episodes.id'], ),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.create_index('ix_episodes_group', ['group_id'], unique=False)
        batch_op.create_index('ix_episodes_run_status', ['run_id', 'status'], unique=False)

    op.create_table('messages',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('episode_id', sa.Integer(), nullable=False),
    sa.Column('turn_index', sa.Integer(), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('content', sa.Text(), nullable=False),
    sa.Column('tool_calls', sa.JSON(), nullable=True),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('messages', schema=None) as batch_op:
        batch_op.create_index('ix_messages_episode', ['episode_id', 'position'], unique=False)

    op.create_table('tool_calls',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('episode_id', sa.Integer(), nullable=False),
    sa.Column('turn_index', sa.Integer(), nullable=False),
    sa.Column('call_index', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('arguments', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('output', sa.Text(), nullable=False),
    sa.Column('exit_status', sa.Integer(), nullable=True),
    sa.Column('duration_s', sa.Double(), nullable=False),
    sa.Column('sandbox_error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('tool_calls', schema=None) as batch_op:
        batch_op.create_index('ix_tool_calls_episode', ['episode_id', 'turn_index'], unique=False)

    op.create_table('turns',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('episode_id', sa.Integer(), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('span_start', sa.Integer(), nullable=False),
    sa.Column('num_tokens', sa.Integer(), nullable=False),
    sa.Column('num_prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('finish_reason', sa.String(length=32), nullable=True),
    sa.Column('drift', sa.Boolean(), nullable=False),
    sa.Column('started_at', sa.Double(), nullable=False),
    sa.Column('finished_at', sa.Double(), nullable=False),
    sa.Column('codec', sa.String(length=8), nullable=False),
    sa.Column('token_ids', sa.LargeBinary(), nullable=False),
    sa.Column('logprobs', sa.LargeBinary(), nullable=False),
    sa.Column('loss_mask', sa.LargeBinary(), nullable=False),
    sa.Column('versions', sa.LargeBinary(), nullable=False),
    sa.Column('routed_experts', sa.LargeBinary(), nullable=True),
    sa.Column('experts_shape', sa.String(length=32), nullable=True),
    sa.Column('trainer_logprobs', sa.LargeBinary(), nullable=True),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('episode_id', 'index')
    )


def downgrade() -> None:
    op.drop_table('turns')
    with op.batch_alter_table('tool_calls', schema=None) as batch_op:
        batch_op.drop_index('ix_tool_calls_episode')

    op.drop_table('tool_calls')
    with op.batch_alter_table('messages', schema=None) as batch_op:
        batch_op.drop_index('ix_messages_episode')

    op.drop_table('messages')
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.drop_index('ix_episodes_run_status')
        batch_op.drop_index('ix_episodes_group')

    op.drop_table('episodes')
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.drop_index('ix_groups_run_status')

    op.drop_table('groups')
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_index('ix_tasks_run_key')

    op.drop_table('tasks')
    op.drop_table('policy_versions')
    op.drop_table('runs')
