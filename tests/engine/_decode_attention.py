"""Run in the engine environment (tests/engine/test_decode_attention.py): SGLang's own decode
attention (`TorchNativeAttnBackend._run_sdpa_forward_decode`, unpatched) against shim 5 of
agent_rl/engine/sglang_cpu on the same paged KV cache. Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import sys
import types

# sitecustomize ran when this interpreter started: with the shim off, SGLang's own methods are
# imported below, then patched by hand.
assert os.environ.get("AGENT_RL_ENGINE_FAST_ATTENTION") == "0", "run with the shim off"

import sitecustomize  # noqa: E402  (agent_rl/engine/sglang_cpu, first on PYTHONPATH)
import torch  # noqa: E402
from sglang.srt.layers.attention import torch_native_backend  # noqa: E402

backend = torch_native_backend.TorchNativeAttnBackend
sglang_s = backend._run_sdpa_forward_decode
SGLANG_EXTEND = backend._run_sdpa_forward_extend
sitecustomize._patch_torch_native_backend(torch_native_backend)
ours = backend._run_sdpa_forward_decode
assert ours is not sglang_s, "the shim did not patch the backend"
# The method reads nothing of `self` but its static helpers: an instance without __init__.
self = object.__new__(backend)

g = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
cases = [  # heads, kv heads, sequence lengths, sliding window
    (2, 2, [1, 7, 300, 64, 1000, 2], None),
    (4, 2, [33, 1, 1, 700, 4096], None),  # grouped-query attention, a 4k sequence
    (2, 2, [5], None),  # one request
    (2, 2, [12, 90, 40], 16),  # a sliding window: SGLang's own path
]


def attend(method, query, pool, seq_lens, **kw):  # type: ignore[no-untyped-def]
    out = torch.full_like(query, float("nan"))
    method(self, query.clone(), out, k_cache, v_cache, req_to_token, pool, seq_lens, **kw)
    return out


for heads, kv_heads, lengths, window in cases:
    head_size, slots = 64, 8192
    k_cache = torch.randn(slots, kv_heads, head_size, generator=g)
    v_cache = torch.randn(slots, kv_heads, head_size, generator=g)
    req_to_token = torch.zeros(16, 4096, dtype=torch.int32)
    pool = torch.randperm(16, generator=g)[: len(lengths)]
    free = torch.randperm(slots - 1, generator=g) + 1  # slot 0 is SGLang's padding slot
    used = 0
    for row, length in zip(pool.tolist(), lengths):
        req_to_token[row, :length] = free[used : used + length].int()
        used += length
    query = torch.randn(len(lengths), heads, head_size, generator=g)
    seq_lens = torch.tensor(lengths)
    kw = dict(scaling=head_size**-0.5, enable_gqa=heads != kv_heads, sliding_window_size=window)
    theirs, batch = attend(sglang_s, query, pool, seq_lens, **kw), attend(ours, query, pool, seq_lens, **kw)
    # Each request decoded alone gives, bit for bit, its row of the batch.
    alone = [attend(ours, query[i : i + 1], pool[i : i + 1], seq_lens[i : i + 1], **kw)
             for i in range(len(lengths))]
    print(json.dumps({"heads": heads, "kv_heads": kv_heads, "lengths": lengths, "window": window,
                      "max_abs_diff": float((theirs - batch).abs().max()),
                      "finite": bool(torch.isfinite(batch).all()),
                      "batch_invariant": all(torch.equal(a[0], batch[i]) for i, a in enumerate(alone))}),
          flush=True)

# Prefill (extend): new tokens after a cached prefix, causal, against SGLang's whole-sequence
# loop; and each request alone against its rows of the batch.
for heads, kv_heads, prefixes, news in [(2, 2, [0, 5, 300, 0], [7, 1, 40, 1]),
                                        (4, 2, [2000, 0, 17], [64, 300, 3])]:
    head_size, slots = 64, 8192
    k_cache = torch.randn(slots, kv_heads, head_size, generator=g)
    v_cache = torch.randn(slots, kv_heads, head_size, generator=g)
    req_to_token = torch.zeros(16, 4096, dtype=torch.int32)
    pool = torch.randperm(16, generator=g)[: len(news)]
    free = torch.randperm(slots - 1, generator=g) + 1
    used = 0
    lengths = [p + n for p, n in zip(prefixes, news)]
    for row, length in zip(pool.tolist(), lengths):
        req_to_token[row, :length] = free[used : used + length].int()
        used += length
    query = torch.randn(sum(news), heads, head_size, generator=g)
    args = (torch.tensor(lengths), torch.tensor(prefixes), torch.tensor(news))
    kw = dict(scaling=head_size**-0.5, enable_gqa=heads != kv_heads, causal=True)

    def extend(method, query, pool, *args):  # type: ignore[no-untyped-def]
        out = torch.full_like(query, float("nan"))
        method(self, query.clone(), out, k_cache, v_cache, req_to_token, pool, *args, **kw)
        return out

    theirs = extend(SGLANG_EXTEND, query, pool, *args)
    batch = extend(backend._run_sdpa_forward_extend, query, pool, *args)
    starts = [sum(news[:i]) for i in range(len(news))]
    alone = [extend(backend._run_sdpa_forward_extend, query[s : s + n], pool[i : i + 1],
                    *(a[i : i + 1] for a in args)) for i, (s, n) in enumerate(zip(starts, news))]
    print(json.dumps({"heads": heads, "kv_heads": kv_heads, "prefixes": prefixes, "new": news,
                      "max_abs_diff": float((theirs - batch).abs().max()),
                      "finite": bool(torch.isfinite(batch).all()),
                      "batch_invariant": all(torch.equal(a, batch[s : s + n]) for a, s, n
                                             in zip(alone, starts, news))}), flush=True)

# The next forward pass on the same tensors, rewritten in place (same requests, same lengths,
# other slots): the slots each layer reuses within a pass are read again once the pass's
# metadata is initialised.
self.use_sliding_window_kv_pool = False
heads, kv_heads, lengths, head_size, slots = 4, 2, [40, 3, 500], 64, 8192
k_cache = torch.randn(slots, kv_heads, head_size, generator=g)
v_cache = torch.randn(slots, kv_heads, head_size, generator=g)
req_to_token = torch.zeros(16, 4096, dtype=torch.int32)
pool, seq_lens = torch.randperm(16, generator=g)[: len(lengths)], torch.tensor(lengths)
query = torch.randn(len(lengths), heads, head_size, generator=g)
kw = dict(scaling=head_size**-0.5, enable_gqa=True)
diffs = []
for _ in range(2):
    free = torch.randperm(slots - 1, generator=g) + 1
    for row, length in zip(pool.tolist(), lengths):
        req_to_token[row, :length] = free[:length].int()
        free = free[length:]
    backend.init_forward_metadata(self, types.SimpleNamespace(out_cache_loc=None))
    batch = attend(ours, query, pool, seq_lens, **kw)  # every layer of the pass
    diffs.append(float((attend(sglang_s, query, pool, seq_lens, **kw) - batch).abs().max()))
print(json.dumps({"passes": 2, "lengths": lengths, "max_abs_diff": max(diffs),
                  "finite": bool(torch.isfinite(batch).all()), "batch_invariant": True}),
      flush=True)
