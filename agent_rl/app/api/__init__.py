"""The web API and episode viewer over the trajectory store.

    app = create_app(config)                       # opens the Store in its lifespan
    app = create_app(config, store=store)          # borrows one (how `serve` mounts it)
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_api, app, config.api)

Routes are in `agent_rl.app.api.routes` (one module per resource), response models in
`agent_rl.app.api.schemas`, dependencies (the store, the token checks) in `agent_rl.app.api.deps`.
"""

from __future__ import annotations

from agent_rl.app.api.app import API_PREFIX, create_app, serve_api

__all__ = ["API_PREFIX", "create_app", "serve_api"]
