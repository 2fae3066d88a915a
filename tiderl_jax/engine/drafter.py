"""WAR's model-free drafter: draft tokens from a suffix index over earlier token sequences (no JAX).

Agentic outputs repeat themselves: tool-call syntax, argument names, values copied from an observation,
the same plan across the samples of one GRPO group and across epochs of one task. The drafter proposes
the next tokens of a sequence by finding its current suffix in what came before and copying what
followed there, as WAR's suffix-tree drafter (and SuffixDecoding) do.

`SuffixIndex` is a suffix trie truncated at depth `max_match`, stored as one hash table per depth: for
every position i of every indexed sequence and every n in 1..max_match, the n tokens before i map to
the token at i, with how often that continuation was seen and when last. Drafting extends the draft
one token at a time: the longest suffix (of the context plus the draft so far, at least `min_match`
tokens) present in the index gives the next token, its most frequent continuation (ties: the most
recent); the draft stops when no suffix matches or at `k` tokens. Indexing costs O(max_match) per
token, drafting O(k * max_match) lookups.

What is indexed (`Drafter`): per draft key (a task, a GRPO group: `Request.draft_key`; by default a
sequence's own group of `submit_group` samples), every sequence's context as it grows (prompt,
generated tokens, observations) and whatever a caller adds (`add`: earlier trajectories of the task).
Memory is bounded by the tokens indexed over all keys, `max_tokens` (`EngineConfig.draft_max_tokens`):
indexing past it drops the least recently used keys whole (a key alone indexes at most `max_tokens`),
and by the key count, `max_keys`. Measured with tracemalloc (`SuffixIndex`, max_match 6, CPython 3.11):
about 2,240 bytes per indexed token for novel tokens (random ids of a 32k vocabulary: every n-gram new,
the worst case), 1,230 for templated agentic-like text, 700 for English text as bytes; so the default
1M tokens holds at most about 2.3 GB.

Speculation is exact whatever the drafter proposes (`sampling.verify_drafts` accepts or rejects each
draft token against the model); a better drafter only makes more of them accepted.
"""

from __future__ import annotations

import collections
from typing import Hashable, Sequence


class SuffixIndex:
    """Continuations of every n-gram (n = 1..max_match) of the sequences indexed so far."""

    def __init__(self, max_match: int = 6):
        if max_match < 1:
            raise ValueError(f"max_match={max_match} must be >= 1")
        self.max_match = max_match
        # suffix tuple -> {next token: [count, last seen]}
        self._next: dict[tuple[int, ...], dict[int, list[int]]] = {}
        self._clock = 0
        self.num_tokens = 0

    def extend(self, context: Sequence[int], new: Sequence[int]) -> None:
        """Indexes the tokens `new`, which follow `context` (only its last max_match tokens are read)."""
        m = self.max_match
        window = list(context[-m:]) if m else []
        for tok in new:
            tok = int(tok)
            self._clock += 1
            for n in range(1, min(m, len(window)) + 1):
                key = tuple(window[-n:])
                conts = self._next.get(key)
                if conts is None:
                    conts = self._next[key] = {}
                entry = conts.get(tok)
                if entry is None:
                    conts[tok] = [1, self._clock]
                else:
                    entry[0] += 1
                    entry[1] = self._clock
            window.append(tok)
            if len(window) > m:
                del window[0]
        self.num_tokens += len(new)

    def next_token(self, context: Sequence[int], min_match: int = 1) -> int | None:
        """The most frequent continuation of the longest suffix of `context` seen before, or None."""
        for n in range(min(self.max_match, len(context)), min_match - 1, -1):
            conts = self._next.get(tuple(context[-n:]))
            if conts:
                return max(conts.items(), key=lambda kv: (kv[1][0], kv[1][1]))[0]
        return None

    def draft(self, context: Sequence[int], k: int, min_match: int = 1) -> list[int]:
        """Up to `k` tokens to follow `context`."""
        tail = list(context[-self.max_match:])
        out: list[int] = []
        while len(out) < k:
            tok = self.next_token(tail, min_match)
            if tok is None:
                break
            out.append(tok)
            tail.append(tok)
            if len(tail) > self.max_match:
                del tail[0]
        return out


class Drafter:
    """Suffix indexes by draft key, LRU, at most `max_tokens` indexed over all keys and `max_keys` keys."""

    def __init__(self, max_match: int = 6, min_match: int = 1, max_keys: int = 4096,
                 max_tokens: int = 1 << 20):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match={min_match} <= max_match={max_match}")
        if min(max_keys, max_tokens) < 1:
            raise ValueError(f"need max_keys={max_keys} and max_tokens={max_tokens} >= 1")
        self.max_match, self.min_match = max_match, min_match
        self.max_keys, self.max_tokens = max_keys, max_tokens
        self._indexes: collections.OrderedDict[Hashable, SuffixIndex] = collections.OrderedDict()
        self.num_tokens = 0  # indexed over all keys

    def index(self, key: Hashable) -> SuffixIndex:
        idx = self._indexes.get(key)
        if idx is None:
            idx = self._indexes[key] = SuffixIndex(self.max_match)
            while len(self._indexes) > self.max_keys:
                self._evict()
        else:
            self._indexes.move_to_end(key)
        return idx

    def _evict(self) -> None:
        """Drops the least recently used key."""
        _, idx = self._indexes.popitem(last=False)
        self.num_tokens -= idx.num_tokens

    def add(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Indexes a whole earlier sequence (a trajectory of the task) under `key`."""
        self.extend(key, (), tokens)

    def extend(self, key: Hashable, context: Sequence[int], new: Sequence[int]) -> None:
        """Indexes `new`, the tokens that follow `context`, under `key`; least recently used keys are dropped
        to stay within `max_tokens` (one key alone indexes at most `max_tokens`: the rest of `new` is not)."""
        idx = self.index(key)
        new = new[:self.max_tokens - idx.num_tokens]
        if not new:
            return
        idx.extend(context, new)
        self.num_tokens += len(new)
        while self.num_tokens > self.max_tokens:  # `key` is the most recent: the others go first
            self._evict()

    def draft(self, key: Hashable, context: Sequence[int], k: int) -> list[int]:
        idx = self._indexes.get(key)
        if idx is None or k <= 0:
            return []
        self._indexes.move_to_end(key)
        return idx.draft(context, k, self.min_match)

    def __len__(self) -> int:
        return len(self._indexes)
