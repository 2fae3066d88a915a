"""Host-side bookkeeping of the paged KV pool: page allocation with reference counts, and the prefix cache.

The device holds the pages (`PagedKV`); this module decides which page holds what. A page is in
exactly one of three states:

- **free**: holds nothing; on the free list;
- **in use**: referenced by `refcount >= 1` sequences (the G samples of one prompt share its pages);
- **cached**: refcount 0 but its content is a registered prefix block, kept on an LRU list so a
  later request with the same prefix reuses it; evicted (oldest first) when a page is needed and
  the free list is empty.

Prefix blocks are identified by a hash chain: block i's key hashes (policy version, block i's
tokens and the image content at its positions, block i-1's key), so a block is only reused behind
the very same prefix (images included) and under the same weights. A sequence that waits on a tool keeps its references, so its pages are never evicted while
it waits; only preemption (engine.py) takes them away.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np

from tiderl_jax.engine.paged_attention import TRASH_PAGE


def block_key(parent: bytes | None, tokens: Sequence[int], version: int, images: bytes = b"") -> bytes:
    """The prefix-cache key of one full block of tokens behind `parent` (a 16-byte hash chain).

    `images`: the block's image content (`vision.content_key`), b"" for a block of text.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(int(version).to_bytes(8, "little", signed=True))
    h.update(np.asarray(tokens, np.int64).tobytes())
    h.update(images)
    return h.digest()


class OutOfPages(Exception):
    """No free page and no cached page to evict: the caller must preempt a sequence."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the trash page)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = np.zeros(num_pages, np.int32)
        self.refcount[TRASH_PAGE] = 1  # never handed out
        self._free = collections.deque(p for p in range(num_pages) if p != TRASH_PAGE)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, refcount 0
        self._key_to_page: dict[bytes, int] = {}
        self._page_key: dict[int, bytes] = {}
        self.evictions = 0

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Pages obtainable without preempting anyone: free + evictable cached."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_free

    # ------------------------------------------------------------------ verbs

    def allocate(self) -> int:
        """A page with refcount 1; evicts the least recently used cached page if none is free."""
        if self._free:
            page = self._free.popleft()
        elif self._lru:
            page, _ = self._lru.popitem(last=False)
            del self._key_to_page[self._page_key.pop(page)]
            self.evictions += 1
        else:
            raise OutOfPages()
        self.refcount[page] = 1
        return page

    def fork(self, page: int) -> int:
        """Another reference to an in-use page (a sibling sample shares it)."""
        assert self.refcount[page] >= 1, f"fork of unreferenced page {page}"
        self.refcount[page] += 1
        return page

    def release(self, page: int) -> None:
        """Drops one reference; at zero the page is cached (if it is a registered block) or freed."""
        assert self.refcount[page] >= 1 and page != TRASH_PAGE, f"release of free page {page}"
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self._page_key:
                self._lru[page] = None
            else:
                self._free.append(page)

    def contains(self, key: bytes) -> bool:
        """Whether block `key` is cached (nothing taken, the LRU order unchanged)."""
        return key in self._key_to_page

    def lookup(self, key: bytes) -> int | None:
        """The page holding block `key`, with a new reference taken; None on a miss."""
        page = self._key_to_page.get(key)
        if page is None:
            return None
        if self.refcount[page] == 0:
            del self._lru[page]
        self.refcount[page] += 1
        return page

    def register(self, page: int, key: bytes) -> None:
        """Marks an in-use page as holding block `key` (first registration of a key wins)."""
        if key in self._key_to_page or page in self._page_key:
            return
        self._key_to_page[key] = page
        self._page_key[page] = key

    def drop_cached(self) -> int:
        """Frees every cached (unreferenced) page; returns how many."""
        n = len(self._lru)
        for page in list(self._lru):
            del self._key_to_page[self._page_key.pop(page)]
            self._free.append(page)
        self._lru.clear()
        return n
