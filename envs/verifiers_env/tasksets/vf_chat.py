"""`vf_chat`: a verifiers v1 harness that answers each user turn with one chat call, its loop
run in-process (verifiers' own `null` harness does the same in a program it installs with `uv`
at run time, which an offline machine cannot). Written against verifiers' public API only.

It hosts a user (`SUPPORTS_RESUME`): an env that plays the user, as verifiers' TextArena and
OpenEnv tasksets do, gets each segment's conversation relaunched here and one reply. Pick it
with `{"player": {"harness": {"id": "vf_chat"}}}` (the seat's name is the env's).
"""

from __future__ import annotations

import verifiers.v1 as vf
from vf_client import interception_client


class ChatHarnessConfig(vf.HarnessConfig):
    id: str = "vf_chat"


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        async with interception_client(endpoint, secret) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatHarness"]
