"""The API's routes, one module per resource; `api_router` gathers the JSON ones."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from agent_rl.api.deps import read_access
from agent_rl.api.errors import ERROR_RESPONSES
from agent_rl.api.routes import episodes, events, fork, groups, replay, runs, stats

api_router = APIRouter(responses=ERROR_RESPONSES)
# Reads are open on loopback only; replay and fork add the bearer token on their own routes.
for module in (episodes, groups, runs, stats, events):
    api_router.include_router(module.router, dependencies=[Depends(read_access)])
for module in (replay, fork):
    api_router.include_router(module.router)
