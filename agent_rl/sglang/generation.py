"""What SGLang's `/generate` takes and gives, as data: the request's options, the decoded
response (`Generation`: token ids, logprobs, the weight version of each span of tokens, the
finish reason, the routed experts as an int32 array `[prompt + completion - 1 -
routed_experts_start_len, layers, topk]`), and the request body's JSON with `TokenIds`, an
episode's growing context that keeps its own JSON text. `agent_rl.sglang.client` speaks the
protocol; this module is what its callers and the recorded episodes share.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from typing_extensions import TypedDict

from agent_rl.kernel import jsonfast
from agent_rl.kernel.encoding import version_label
from agent_rl.kernel.errors import EngineError


class GenerateOptions(TypedDict, total=False):
    """Per-request options of `generate` and `stream`."""

    rid: str | None
    """Request id (abort it by this id)."""
    return_logprob: bool
    """Ask for each output token's logprob (default True)."""
    return_routed_experts: bool
    """MoE: ask for the experts that routed every position (routing replay)."""
    routed_experts_start_len: int
    """Routed experts from this position on (earlier ones are already known)."""
    extra: dict[str, Any] | None
    """More /generate fields, sent as they are."""
    routing_key: str | None
    """Session key for the router's affinity (the `X-SMG-Routing-Key` header): the turns of
    one episode stay on one worker, whose radix cache holds their prefix."""


@dataclass(frozen=True)
class FinishReason:
    """Why generation ended: "stop" (eos or a stop string/token, `matched`), "length"
    (`max_new_tokens` reached), or "abort" (aborted, paused with mode=abort, or an error)."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> FinishReason | None:
        if raw is None:
            return None
        return cls(raw.get("type", ""), raw.get("matched"), raw.get("length"), raw.get("message"))


@dataclass(frozen=True)
class WeightSpan:
    """Output tokens [start, end) were sampled by the weights published as `version`."""

    version: str
    start: int
    end: int


@dataclass
class Generation:
    """One decoded /generate response (or one cumulative chunk of a stream)."""

    rid: str
    output_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[float] | None
    weight_version: str | None
    weight_spans: list[WeightSpan]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    routed_experts: np.ndarray | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def aborted(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.type == "abort"

    @classmethod
    def from_response(
        cls, body: dict[str, Any], moe_topk: int | None = None, routed_experts_start_len: int = 0
    ) -> Generation:
        meta = body.get("meta_info") or {}
        output_ids = list(body.get("output_ids") or [])
        token_logprobs = meta.get("output_token_logprobs")
        logprobs = None
        if token_logprobs is not None:
            # [[logprob, token_id, text|None], ...]; the ids are checked against output_ids.
            if [t[1] for t in token_logprobs] != output_ids:
                raise EngineError("engine response: output_token_logprobs do not match output_ids")
            logprobs = [float(t[0]) for t in token_logprobs]
        spans = [
            WeightSpan(version_label(s["version"]), int(s["start"]), int(s["end"]))
            for s in meta.get("weight_versions") or []
        ]
        experts, routed = meta.get("routed_experts"), None
        if isinstance(experts, str):
            # One row per position whose next token was computed: all but the last token.
            prompt, completion = int(meta.get("prompt_tokens", 0)), len(output_ids)
            rows = prompt + completion - 1 - routed_experts_start_len
            routed = decode_routed_experts(experts, rows, moe_topk)
        return cls(
            rid=str(meta.get("id", "")),
            output_ids=output_ids,
            text=body.get("text", ""),
            finish_reason=FinishReason.parse(meta.get("finish_reason")),
            logprobs=logprobs,
            weight_version=meta.get("weight_version"),
            weight_spans=spans,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            routed_experts=routed,
            meta_info=meta,
        )


class TokenIds(list):  # type: ignore[type-arg]
    """Token ids that keep their own JSON text as they grow (extend and append only).

    SGLang's `/generate` takes the whole context with every turn of an episode; encoding it
    anew each turn cost time that grew with the conversation (~0.2 ms per 2k tokens). A
    `TokenIds` encodes each id once, when it is added, and `generate` sends the kept text."""

    __slots__ = ("_json",)

    def __init__(self, ids: Sequence[int] = ()) -> None:
        super().__init__(ids)
        self._json = ",".join(map(str, self))

    def extend(self, ids: Sequence[int]) -> None:  # type: ignore[override]
        if not isinstance(ids, (list, tuple)):
            ids = list(ids)  # read once, kept twice
        if ids:
            super().extend(ids)
            piece = ",".join(map(str, ids))
            self._json = f"{self._json},{piece}" if self._json else piece

    def append(self, i: int) -> None:
        self.extend([i])

    def __iadd__(self, ids: Sequence[int]) -> TokenIds:  # type: ignore[override]
        self.extend(ids)
        return self

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("TokenIds only grow (extend, append): copy it into a list to edit it")

    insert = pop = remove = clear = sort = reverse = __setitem__ = __delitem__ = __imul__ = _refuse  # type: ignore[assignment]

    def json(self) -> str:
        return f"[{self._json}]"

    def mark(self) -> tuple[int, int]:
        """Where the ids end now, for `rewind`."""
        return len(self), len(self._json)

    def rewind(self, mark: tuple[int, int]) -> None:
        """Drop every id added since `mark` (a call that did not complete takes back its prompt)."""
        count, chars = mark
        list.__delitem__(self, slice(count, None))
        self._json = self._json[:chars]


def json_body(body: dict[str, Any]) -> bytes:
    """A request body's JSON; `input_ids` given as `TokenIds` is spliced in as it is kept."""
    ids = body.get("input_ids")
    if not isinstance(ids, TokenIds):
        return jsonfast.dumps(body)
    rest = jsonfast.dumps({k: v for k, v in body.items() if k != "input_ids"})
    return b'{"input_ids":' + ids.json().encode() + (b"," + rest[1:] if rest != b"{}" else b"}")


def decode_routed_experts(b64: str, rows: int, topk: int | None) -> np.ndarray:
    """Base64 of little-endian int32 -> [rows, layers, topk] ([rows, layers * topk] if topk is
    unknown: the payload does not say how a row splits into layers and experts)."""
    flat = np.frombuffer(base64.b64decode(b64), dtype="<i4").astype(np.int32)
    if rows <= 0 or flat.size % rows:
        raise EngineError(f"engine response: {flat.size} routed-expert ids do not fill {rows} rows")
    if topk is None:
        return flat.reshape(rows, -1)
    if flat.size % (rows * topk):
        raise EngineError(
            f"engine response: {flat.size} routed-expert ids do not fit [{rows}, -1, {topk}]"
        )
    return flat.reshape(rows, -1, topk)
