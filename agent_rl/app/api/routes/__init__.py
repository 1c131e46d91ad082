"""The API's routes, one module per resource; `api_router` gathers the JSON ones."""

from __future__ import annotations

from fastapi import APIRouter

from agent_rl.app.api.errors import ERROR_RESPONSES
from agent_rl.app.api.routes import audit, episodes, events, fork, groups, replay, runs, stats

api_router = APIRouter(responses=ERROR_RESPONSES)
# Off loopback every request needs the token (app.TokenGate); replay and fork always do.
for module in (episodes, groups, runs, stats, audit, events, replay, fork):
    api_router.include_router(module.router)
