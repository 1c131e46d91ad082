"""Alembic migrations of the trajectory store (script location `migrations`)."""
