"""Paged KV blocks: allocation with reference counts, and a prefix cache of full blocks.

Each full block whose KV has been computed gets a chained hash: SHA-256 of the previous block's hash and its
token ids. A new sequence reuses the longest chain of cached blocks that starts at its first token (ref count
+ 1) and skips computing them. The block's own token ids are also compared on a hit; the earlier blocks are
vouched for by the chain, which is why it is a cryptographic hash: with Python's `hash()` (64 bits, and
invertible for small ints) a crafted prompt could collide with another request's prefix and be handed its KV
(vLLM left `hash()` for the same reason, CVE-2025-25183). Blocks whose ref count drops to 0 go back to the free list
but keep their hash (and KV) until they are handed out again, so a later request can still hit them.
Hashes are registered only once a block's KV is written (`cache_full_blocks`), never at allocation, so a
sequence can never read a block another sequence has not computed yet.
"""
from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict

from jaxinfer.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(prev: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """The block's hash: SHA-256 of the previous block's (or the chain's seed) and its token ids as int64s."""
    h = hashlib.sha256(prev or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salt_seed(cache_salt: str | None) -> bytes | None:
    """The start of a request's chain: its cache_salt hashed (None: no salt; salted chains never meet unsalted)."""
    return None if cache_salt is None else hashlib.sha256(b"cache_salt\0" + cache_salt.encode()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # FIFO = LRU
        self.cached: dict[bytes, int] = {}      # hash -> block id
        self.prefix_caching = enable_prefix_caching
        self.query_tokens = 0                   # tokens looked up in the cache (allocate): vLLM's prefix_cache_queries

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    # -- prefix cache -----------------------------------------------------------------------------
    def reset_prefix_cache(self, in_use: bool = False) -> int:
        """Forget every cached block that no sequence holds (their KV can no longer be hit); returns how
        many were forgotten. Blocks in use stay cached, unless `in_use`: then no request can hit them either
        (their holders keep using their KV; a block keeps its hash, so a later one of theirs chains on)."""
        forgotten = 0
        for bid in self.free:
            b = self.blocks[bid]
            if b.hash is not None:
                if self.cached.get(b.hash) == bid:
                    del self.cached[b.hash]
                b.hash, b.token_ids = None, ()
                forgotten += 1
        if in_use:
            forgotten, self.cached = forgotten + len(self.cached), {}
        return forgotten

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached chain for seq. The block holding the last token is never
        reused, so the last token is always computed (its logits give the next token)."""
        if not self.prefix_caching or not seq.reuses_prefix_cache:
            return []
        hits, h = [], seq.hash_seed
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block_tokens(i)
            h = chain_hash(h, tokens)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            hits.append(bid)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of seq's full blocks whose KV is now computed (only the new ones)."""
        if not self.prefix_caching:
            return
        known = min(seq.num_computed_tokens, len(seq) - seq.num_pending)   # KV written AND token known
        full = min(known // self.block_size, len(seq.block_table))
        h = seq.last_hash if seq.num_hashed_blocks else seq.hash_seed
        for i in range(seq.num_hashed_blocks, full):
            tokens = seq.block_tokens(i)
            h = chain_hash(h, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash != h:
                if block.hash is not None and self.cached.get(block.hash) == block.block_id:
                    del self.cached[block.hash]
                block.hash, block.token_ids = h, tokens
                self.cached.setdefault(h, block.block_id)
        if full > seq.num_hashed_blocks:
            seq.num_hashed_blocks, seq.last_hash = full, h

    # -- allocation -------------------------------------------------------------------------------
    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.cached.get(block.hash) == bid:
            del self.cached[block.hash]          # its old contents are about to be overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return bid

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return seq.num_blocks_needed - len(hits) + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> int:
        """Give seq blocks for all its current tokens, reusing cached prefix blocks; returns the tokens found
        cached. seq.num_cached_tokens (RequestOutput's, as vLLM's) is set at its first admission only: a
        preempted sequence that comes back finds its own blocks, not a prompt prefix."""
        assert not seq.block_table, f"{seq} already has blocks"
        hits = self._cached_prefix(seq)
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
        seq.block_table = hits + [self._take_free() for _ in range(seq.num_blocks_needed - len(hits))]
        seq.num_computed_tokens = len(hits) * self.block_size
        self.query_tokens += len(seq) if self.prefix_caching else 0
        if not seq.admitted:
            seq.num_cached_tokens, seq.admitted = seq.num_computed_tokens, True
            seq.first_scheduled_time = time.perf_counter()
        seq.num_hashed_blocks = len(hits)
        seq.last_hash = self.blocks[hits[-1]].hash if hits else None
        return seq.num_computed_tokens

    def recount(self, seqs) -> None:
        """Rebuild every block's ref count, the free list and the prefix cache's index from the sequences that hold
        blocks (`seqs`: all of them), after an exception that may have come in the middle of allocate or free_seq.
        Free blocks keep their LRU order; blocks nobody holds any more join the free list's end."""
        refs = [0] * len(self.blocks)
        for seq in seqs:
            for bid in seq.block_table:
                refs[bid] += 1
        free = OrderedDict((bid, None) for bid in self.free if refs[bid] == 0)
        for block, n in zip(self.blocks, refs):
            block.ref_count = n
            if n == 0 and block.block_id not in free:
                free[block.block_id] = None
        self.free = free
        self.cached = {h: bid for h, bid in self.cached.items() if self.blocks[bid].hash == h}

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of every current token (a decode step adds one block at most)."""
        return seq.num_blocks_needed - len(seq.block_table) <= self.num_free_blocks

    def append(self, seq: Sequence) -> None:
        while len(seq.block_table) < seq.num_blocks_needed:
            seq.block_table.append(self._take_free())

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for num_tokens tokens (look-ahead for a K-step decode call: its rows' placeholder tokens)."""
        while len(seq.block_table) < -(-num_tokens // self.block_size):
            seq.block_table.append(self._take_free())

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references; blocks at ref 0 go to the free list, keeping their hash."""
        table, seq.block_table = seq.block_table, []     # first: an interrupted free never runs twice
        for bid in reversed(table):             # tail blocks first: the prefix stays cached longest
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
        seq.num_computed_tokens = seq.num_hashed_blocks = 0
        seq.last_hash = None
