"""One loaded model's prompt cache: every conversation's KV cache and every prompt snapshot.

An agent's traffic interleaves conversations on one model: its main conversation, a side
request, a subagent with its own system prompt, other agents. Each conversation's cache
is an entry here, keyed by exactly the tokens it has seen in mlx-lm's `PromptTrie` (the
trie of token prefixes of its server's `LRUPromptCache`), so a request from one
conversation never costs another its cache.

A request checks its cache out (`find`, then `check_out`) and back in after the reply
(`check_in`):

- a conversation whose tokens the prompt extends is moved out, not copied, and back in
  grown by the turn;
- a conversation the prompt shares part of is cut back where it diverges when the prompt
  holds all of its turns (a thinking template that re-renders the last reply without its
  reasoning: the same conversation, so the cache is moved and cut in place); otherwise
  (another session on the same system prompt) the request gets a copy of the shared part
  and the conversation stays;
- a cache that cannot be cut back (`kv.rewinds`: linear attention, a sliding window,
  chunked attention) resumes instead from the longest snapshot inside the shared prefix
  (engine/snapshots.py), a copy, since a snapshot serves many prompts; a conversation
  superseded that way is dropped.

Two different images can be the same placeholder tokens, so each entry is also keyed by
the digests of the images it has seen, in order: a prompt uses it only when its images
and the entry's agree as far as both go. Each entry is kept under its KV layout.

Memory is counted as the memory plan counts it (engine/footprint.kv_cache_bytes, the same
arithmetic on every rank of a pipeline, so every rank keeps and evicts the same entries):
the conversations, the running request's included, within the KV cache the plan holds
for the context (`bound`): a request checked out first evicts the least recently used
conversations until its cache at its full token budget fits beside them; the snapshots
within their own `snapshots` count and `snapshot_memory` bytes, every-N ones evicted
first, those at the end of a system prompt last. The conversation cache on disk
(engine/disk_cache.py) is the second tier: each reply is saved there, so an evicted
conversation comes back from disk.

Each reuse says where its tokens came from (`Reuse.source`: "memory", a conversation;
"snapshot"; "disk") and, when it reuses less than the prompt shares with what is held,
why (`Reuse.note`).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from .kv import FULL_PRECISION, KVSpec, make_cache, rewinds
from .snapshots import INTERVAL, SYSTEM, TURNS, SnapshotSpec

CONVERSATION = "conversation"
EVICTED_FIRST = (INTERVAL, TURNS, SYSTEM)  # the snapshots' kinds, in the order they go


@dataclass
class Reuse:
    """Where a prompt's reused tokens came from, and why not more."""

    source: Optional[str] = None  # "memory", "snapshot" or "disk"; None: nothing reused
    note: Optional[str] = None  # why less than the prompt's prefix shared with what is held


@dataclass
class Lease:
    """A request's cache while it is checked out: it has seen exactly `tokens` (the first
    `reused` of them before the request) under layout `kv`, showing `images`."""

    cache: list
    tokens: list[int]
    kv: KVSpec
    images: tuple[str, ...]
    reused: int
    reuse: Reuse
    turns: int  # where the prompt's finished turns end: a later prompt holding them continues it

    def fed(self, tokens) -> None:
        """Record tokens that went through the model into the cache."""
        self.tokens.extend(int(t) for t in tokens)


@dataclass
class _Entry:
    cache: list
    kind: str  # CONVERSATION or a snapshot's kind
    nbytes: int
    turns: int = 0  # a conversation's: Lease.turns


@dataclass
class Hit:
    """What the store can give a prompt, found before anything moves: `check_out` takes it."""

    prompt: list[int]
    kv: KVSpec
    images: tuple[str, ...]
    reused: int = 0
    how: Optional[str] = None  # "move", "cut", "copy" (a prefix of a conversation), "snapshot"
    key: Optional[tuple] = None  # (namespace, tokens) of the entry it takes from
    dropped: Optional[tuple] = None  # a conversation it supersedes
    reuse: Reuse = field(default_factory=Reuse)


class PromptCache:
    """One loaded model's conversations and snapshots (this module's docstring says how)."""

    def __init__(self, model, config: dict):
        self.model, self.config = model, config
        self.rewinds = rewinds(make_cache(model, FULL_PRECISION))
        self.snapshots: Optional[SnapshotSpec] = None  # in force: None where the cache rewinds or they are off
        self.max_bytes: Optional[int] = None  # the conversations', the running request's included
        self.reset()

    def reset(self) -> None:
        """Forget every conversation and snapshot (as a new process would)."""
        from mlx_lm.models.cache import PromptTrie

        self._trie = PromptTrie()
        self._entries: dict[str, OrderedDict] = {kind: OrderedDict() for kind in (CONVERSATION, *EVICTED_FIRST)}
        self._bytes = {CONVERSATION: 0, "snapshots": 0}
        self._tokens = 0  # the conversations'

    # -- bounds ---------------------------------------------------------------------------
    def size(self, kv: KVSpec, tokens: int) -> int:
        """Bytes a cache of `tokens` tokens under `kv` counts for, as the memory plan counts it."""
        from .footprint import kv_cache_bytes

        return kv_cache_bytes(self.config, tokens, None, kv)[0]

    def bound(self, snapshots: Optional[SnapshotSpec], max_bytes: Optional[int]) -> None:
        """Keep snapshots as `snapshots` says (None: none) where this model's cache cannot be
        rewound, and conversations within `max_bytes` (None: unbounded)."""
        self.snapshots = None if self.rewinds else snapshots
        self.max_bytes = max_bytes
        self._evict(0)

    def _evict(self, reserve: int) -> None:
        conversations = self._entries[CONVERSATION]
        while conversations and self.max_bytes is not None and self._bytes[CONVERSATION] + reserve > self.max_bytes:
            self._pop(next(iter(conversations)))
        spec = self.snapshots
        while self.snapshot_count and (spec is None or self.snapshot_count > spec.max_count
                                       or self._bytes["snapshots"] > spec.max_bytes):
            kind = next(k for k in EVICTED_FIRST if self._entries[k])
            self._pop(next(iter(self._entries[kind])))

    # -- the trie -------------------------------------------------------------------------
    def _get(self, key: tuple) -> _Entry:
        space, tokens = key
        return self._trie.get(space, tokens)

    def _insert(self, key: tuple, entry: _Entry) -> None:
        space, tokens = key
        previous = self._trie.add(space, list(tokens), entry)
        if previous is not None:
            self._forget(key, previous)
        self._entries[entry.kind][key] = entry
        self._count(entry, len(tokens), +1)

    def _pop(self, key: tuple) -> _Entry:
        space, tokens = key
        entry = self._trie.pop(space, list(tokens))
        self._forget(key, entry)
        return entry

    def _forget(self, key: tuple, entry: _Entry) -> None:
        del self._entries[entry.kind][key]
        self._count(entry, len(key[1]), -1)

    def _count(self, entry: _Entry, tokens: int, sign: int) -> None:
        if entry.kind == CONVERSATION:
            self._bytes[CONVERSATION] += sign * entry.nbytes
            self._tokens += sign * tokens
        else:
            self._bytes["snapshots"] += sign * entry.nbytes

    def _touch(self, key: tuple) -> None:
        self._entries[self._get(key).kind].move_to_end(key)

    def _spaces(self, kv: KVSpec, images: tuple[str, ...]):
        """The namespaces held, each with whether a prompt under `kv` showing `images` may use it."""
        # in the order they are held (not a set's, which hashes strings per process): the same on every rank
        seen = dict.fromkeys(space for entries in self._entries.values() for space, _ in entries)
        for space in seen:
            held_kv, held_images = space
            shared = min(len(images), len(held_images))
            yield space, held_kv == kv and held_images[:shared] == images[:shared]

    # -- a request's cache ----------------------------------------------------------------
    def find(self, prompt: list[int], kv: KVSpec = FULL_PRECISION, images: tuple[str, ...] = ()) -> Hit:
        """The longest prefix of `prompt` (at least one token left to feed) the store can
        give under layout `kv`, showing `images`; nothing is moved until `check_out`."""
        prompt = [int(t) for t in prompt]
        want = prompt[:-1]
        best, common, elsewhere = Hit(prompt, kv, tuple(images)), 0, (0, None)
        diverged = False
        for space, usable in self._spaces(kv, tuple(images)):
            hit, shared, longer = self._find_in(space, want, best)
            if not usable:
                if shared > elsewhere[0]:
                    elsewhere = (shared, "another KV layout" if space[0] != kv else "other images")
                continue
            if hit.reused > best.reused:
                best = hit
            if shared > common or (shared == common and longer):
                common, diverged = shared, longer
        note = None
        if elsewhere[0] > max(best.reused, common):
            note = elsewhere[1]
        elif best.reused < common:
            note = f"no snapshot inside the {common} tokens shared"
        elif diverged and best.reused == common < len(want):
            note = f"diverged at token {common}"
        best.reuse = Reuse({"move": "memory", "cut": "memory", "copy": "memory", "snapshot": "snapshot"}.get(best.how),
                           note)
        return best

    def _find_in(self, space, want: list[int], seed: Hit) -> tuple[Hit, int, bool]:
        """(the best hit in one namespace, the tokens it shares with `want` at most,
        whether an entry there goes on past them)."""
        found = self._trie.search(space, want)
        prefix = found.exact if found.exact is not None else found.shorter
        held = len(prefix) if prefix is not None else 0
        hit = Hit(seed.prompt, seed.kv, seed.images)
        if prefix is not None:
            entry = self._trie.get(space, prefix)
            hit.reused, hit.key = held, (space, tuple(prefix))
            hit.how = "move" if entry.kind == CONVERSATION else "snapshot"
        if found.longer is None or found.common_prefix <= held:
            return hit, held, found.longer is not None
        shared, key = found.common_prefix, (space, tuple(found.longer))
        entry = self._get(key)
        superseded = entry.kind == CONVERSATION and shared >= entry.turns
        if self.rewinds:
            hit.reused, hit.key, hit.how = shared, key, "cut" if superseded else "copy"
        elif superseded:
            hit.dropped = key
        return hit, shared, True

    def check_out(self, hit: Hit, turns: int, budget: int, disk=None) -> Lease:
        """The request's cache for `hit` (or `disk`, a cache found on disk that holds more:
        engine/disk_cache.Found), room made for it at `budget` tokens (its prompt and its
        reply at most); `turns`: where its prompt's finished turns end."""
        kv, reused = hit.kv, hit.reused
        if disk is not None:
            cache, reused = disk.cache, len(disk.tokens)
            reuse = Reuse("disk", hit.reuse.note if reused < len(hit.prompt) - 1 else None)
        else:
            reuse = hit.reuse
            if hit.dropped is not None:
                self._pop(hit.dropped)
            if hit.how in ("move", "cut"):
                entry = self._pop(hit.key)
                cache = entry.cache
                if hit.how == "cut":
                    from mlx_lm.models.cache import trim_prompt_cache

                    trim_prompt_cache(cache, len(hit.key[1]) - reused)
            elif hit.how in ("copy", "snapshot"):
                from .kv_segments import prefix

                entry = self._get(hit.key)
                cache = prefix(entry.cache, reused) if hit.how == "copy" else copy.deepcopy(entry.cache)
                self._touch(hit.key)
            else:
                cache = make_cache(self.model, kv)
        self._evict(self.size(kv, budget))
        return Lease(cache, hit.prompt[:reused], kv, hit.images, reused, reuse, turns)

    def check_in(self, lease: Lease) -> None:
        """Keep a request's cache after its reply, as its conversation's; with a cache
        that can be cut back, the entries its tokens extend go (it serves them)."""
        if not lease.tokens:
            return
        key = ((lease.kv, lease.images), tuple(lease.tokens))
        self._insert(key, _Entry(lease.cache, CONVERSATION, self.size(lease.kv, len(lease.tokens)), lease.turns))
        if self.rewinds:
            for n, entry in self._trie.pop_prefixes(key[0], list(lease.tokens)):
                self._forget((key[0], key[1][:n]), entry)
        self._evict(0)

    # -- snapshots (engine/snapshots.py) ---------------------------------------------------
    def take(self, kv: KVSpec, tokens, cache, kind: str, copied: bool = False) -> list:
        """Keep a snapshot of `cache`, which has seen exactly `tokens` (a copy, unless
        `copied` says it is one already: mlx-lm's BatchGenerator.extract_cache); returns
        what was kept."""
        import mlx.core as mx

        kept = cache if copied else copy.deepcopy(cache)
        mx.eval([c.state for c in kept])  # its own arrays now, not a view of a cache still being fed
        tokens = tuple(int(t) for t in tokens)
        self._insert(((kv, ()), tokens), _Entry(kept, kind, self.size(kv, len(tokens))))
        self._evict(0)
        return kept

    # -- figures ----------------------------------------------------------------------------
    @property
    def conversation_count(self) -> int:
        return len(self._entries[CONVERSATION])

    @property
    def conversation_tokens(self) -> int:
        return self._tokens

    @property
    def conversation_bytes(self) -> int:
        return self._bytes[CONVERSATION]

    @property
    def snapshot_count(self) -> int:
        return sum(len(self._entries[kind]) for kind in EVICTED_FIRST)

    @property
    def snapshot_bytes(self) -> int:
        return self._bytes["snapshots"]

    @property
    def held_bytes(self) -> int:
        """Its conversations' and snapshots' bytes, as the memory plan counts them."""
        return self.conversation_bytes + self.snapshot_bytes

    def conversations(self) -> list[tuple[list[int], list]]:
        """(tokens, cache) of each conversation held, the least recently used first."""
        return [(list(tokens), entry.cache) for (_, tokens), entry in list(self._entries[CONVERSATION].items())]
