"""A replay of PyTorch's CUDA caching allocator: what max_memory_allocated/reserved would say, without a GPU.

Re-implements the native backend of ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) for one
device, one stream and no CUDA graphs: request rounding, the small (<= 1 MiB) and large pools, segment sizes,
best-fit search ordered by (size, address), splitting and merging of blocks, ``max_split_size`` and
``max_non_split_rounding``, expandable segments, and the path taken when a memory cap refuses a cudaMalloc
(garbage collection, freeing oversize blocks, freeing every whole cached segment, retry, OOM).

Addresses matter: best fit breaks ties between equal-sized free blocks by address, and which of two equal blocks
is reused decides where later splits land and so the peak reserved. A block's address is its segment's base plus
its offset. Segment bases come from ``segment_addresses`` when the caller knows the real ones (a recorded trace's
``segment_alloc`` events), else they are fake: each new segment lies below all earlier ones, the dominant pattern
of the CUDA driver's cudaMalloc on an H200 with CUDA 13.0 (``tests/data/allocator_traces``; replayed without real
addresses, "below" matches peak reserved on 10 of 12 recorded runs, "above" on 8, see ``docs/allocator.md``).

Speed, measured on a 2-core AMD EPYC VM with CPython 3.11 on the 101k-event synthetic training stream of
``tests/test_allocator.py``: one replay 0.27 s (expandable segments 0.45 s); ``smallest_fitting_capacity``
(~10 replays) 3.2 s / 2.7 s. Since session 27 it also walks the caps above its bisection's answer (a larger cap can
run out of memory where a smaller one ran): a median of 7 more replays on the zoo's 206 steps, 17 on the 47 of its
second and third draws, 0 on the corpus's validation half; 16 at most before it probes 12 more
(``benchmarks/results/estimate/monotone_caps_*_s27.jsonl``).

Example:
    >>> events = [(+1, 0, 10 * 2**20 + 2**19), (+1, 1, 4096), (-1, 0, 0)]
    >>> r = replay(events)
    >>> r.peak_reserved_bytes // 2**20, r.peak_allocated_bytes
    (14, 11014144)
"""

from __future__ import annotations

import copy
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from memfit.errors import UsageError
from memfit.estimate.allocator_config import ROUNDUP_INTERVALS, AllocatorConfig
from memfit.records import JsonRecord
from memfit.units import MiB, format_bytes

__all__ = ["AllocatorConfig", "CachingAllocator", "Replay", "SimulatedOOM", "replay", "smallest_fitting_capacity"]

# Constants of c10/core/AllocatorConfig.h (namespace c10::CachingAllocator), identical in CUDACachingAllocator.cpp.
MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded up to a multiple of 512 B
SMALL_SIZE = 1 * MiB  # kSmallSize: requests <= 1 MiB go to the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segment size, and small expandable page size
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: requests in (1, 10) MiB get a large_segment_size segment
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests get a segment rounded up to 2 MiB
LARGE_BUFFER = 20 * MiB  # kLargeBuffer (CUDACachingAllocator.cpp): large-pool expandable page size

# ExpandableSegment reserves address space for 1.125 x the card's memory (CUDACachingAllocator.cpp). Only the
# size of the unmapped tail depends on it, and nothing we count; an 80 GiB card is assumed.
_EXPANDABLE_VA_BYTES = 80 * 1024 * MiB * 9 // 8
# Free blocks are kept in one sorted list of ints, size * _SPAN + address, so that bisect orders them by
# (size, address) like BlockComparatorSize. All addresses stay below _SPAN.
_SPAN = 1 << 56
# Real device addresses are user-space virtual addresses, below 2**48 on x86-64 and aarch64 (48-bit VA; CUDA's
# unified address space shares it). Fake segment bases grow down from _FAKE_TOP, far above them, so the two never
# collide when a trace gives real bases for only its first segments.
_REAL_ADDRESS_LIMIT = 1 << 48
_FAKE_TOP = 1 << 55
_UNLIMITED = 1 << 62  # max_split_size unset (SIZE_MAX in PyTorch)


class SimulatedOOM(Exception):
    """The simulated allocator could not serve a request under the memory cap."""

    def __init__(self, requested_bytes: int, alloc_bytes: int, reserved_bytes: int, allocated_bytes: int,
                 capacity_bytes: int | None) -> None:
        self.requested_bytes = requested_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes
        self.capacity_bytes = capacity_bytes
        cap = "no cap" if capacity_bytes is None else f"a cap of {format_bytes(capacity_bytes)}"
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {format_bytes(alloc_bytes)} (request "
            f"{requested_bytes} bytes) under {cap}; {format_bytes(allocated_bytes)} is allocated and "
            f"{format_bytes(reserved_bytes - allocated_bytes)} is reserved but unallocated. If the latter is "
            "large, try expandable_segments:True."
        )


class _Block:
    """A range of one segment: handed out (allocated), cached free, or (expandable) unmapped address space."""

    __slots__ = ("addr", "size", "pool", "prev", "next", "allocated", "mapped", "seg", "gc_base")

    def __init__(self, addr: int, size: int, pool: _Pool, seg: _Segment | None) -> None:
        self.addr = addr
        self.pool = pool
        self.size = size
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = True
        self.seg = seg  # the expandable segment holding this block, None for a cudaMalloc segment
        self.gc_base = 0  # get_free_blocks_call_count when the block last entered the free list


class _Segment:
    """An expandable segment: a large reserved address range mapped page by page."""

    __slots__ = ("base", "page")

    def __init__(self, base: int, page: int) -> None:
        self.base = base
        self.page = page


class _Pool:
    """BlockPool: the free blocks of one size class, sorted by (size, address); unmapped ranges by address."""

    __slots__ = ("small", "keys", "blocks", "unmapped", "gc_calls")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []  # size * _SPAN + addr, sorted
        self.blocks: dict[int, _Block] = {}  # key -> free mapped block
        self.unmapped: dict[int, _Block] = {}  # addr -> unmapped block (expandable segments only)
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, block: _Block) -> None:
        key = block.size * _SPAN + block.addr
        insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.gc_calls

    def remove(self, block: _Block) -> None:
        key = block.size * _SPAN + block.addr
        keys = self.keys
        del keys[bisect_left(keys, key)]
        del self.blocks[key]


class CachingAllocator:
    """One device's caching allocator, driven by malloc/free calls.

    Args:
        config: allocator settings (``AllocatorConfig.from_env()`` reads the user's environment).
        capacity_bytes: the cap ``torch.cuda.set_per_process_memory_fraction`` would set (fraction x total
            memory); None means no cap and no cudaMalloc ever fails.
        segment_addresses: real base addresses of the cudaMalloc'd segments, in the order they were created
            (the ``segment_alloc`` entries of a memory-history trace). Segment k gets the k-th address; later
            segments, and expandable segments, get fake ones. None: all fake. Only for replaying recorded traces.
    """

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), *, capacity_bytes: int | None = None,
                 segment_addresses: Sequence[int] | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise UsageError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}.")
        real = tuple(segment_addresses or ())
        bad = [a for a in real if not 0 < a < _REAL_ADDRESS_LIMIT]
        if bad:
            raise UsageError(f"segment address {bad[0]:#x} is not a device address in (0, 2**48); pass the "
                             "'addr' of the trace's segment_alloc entries, or None for fake addresses.")
        self.config = config
        self.capacity_bytes = capacity_bytes
        self._expandable = config.expandable_segments
        self._max_split = config.max_split_size_bytes if config.max_split_size_bytes is not None else _UNLIMITED
        self._max_non_split = config.max_non_split_rounding_bytes
        self._large_segment = config.large_segment_size_bytes
        self._divisions = config.divisions_table()
        self._any_divisions = any(d > 1 for d in self._divisions)
        # garbage_collect_cached_blocks runs only when a memory fraction is set (set_fraction).
        self._gc = capacity_bytes is not None and config.garbage_collection_threshold > 0.0
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[int, _Block] = {}
        self._real_addresses = real
        self._segments_created = 0  # cudaMalloc'd segments so far, the index into _real_addresses
        self._next_addr = _FAKE_TOP  # the lowest fake address handed out so far
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_segments = 0
        self.lowest_refused_bytes = _UNLIMITED
        """The least reserved + segment size of any cudaMalloc the cap refused. Every cap from the one in force up to
        (not including) this refuses the same requests and so runs the same, unless garbage collection is on (its
        threshold is a fraction of the cap)."""
        self.highest_request_bytes = 0
        """The most reserved + segment size any cudaMalloc asked for so far: every cap at or above it would have run
        the same up to here (no garbage collection)."""

    # -- public API ---------------------------------------------------------------------------------------------

    def malloc(self, key: int, nbytes: int) -> int:
        """Allocate ``nbytes`` (the raw request) under ``key``; return the size of the block handed out.

        Raises:
            SimulatedOOM: the request cannot be served under ``capacity_bytes``.
            UsageError: ``key`` is already live, or ``nbytes`` is not positive.
        """
        if key in self._live:
            raise UsageError(f"allocation key {key} is already live; free it before reusing the key.")
        if nbytes <= 0:
            raise UsageError(f"allocation of {nbytes} bytes (key {key}): sizes must be positive.")
        size = self._round_size(nbytes)
        pool = self._small if size <= SMALL_SIZE else self._large
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._new_block(pool, size)
        # split the remainder off into the pool (should_split)
        remaining = block.size - size
        if pool.small or self._expandable:
            split = remaining >= MIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > SMALL_SIZE
        if split:
            head = _Block(block.addr, size, pool, block.seg)
            head.prev = prev = block.prev
            if prev is not None:
                prev.next = head
            head.next = block
            block.prev = head
            block.addr += size
            block.size = remaining
            pool.insert(block)
            block = head
        block.allocated = True
        self._live[key] = block
        # allocated counts the whole block handed out, slack included (alloc_found_block)
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return block.size

    def free(self, key: int) -> None:
        """Return the block allocated under ``key`` to its pool, merged with free neighbours."""
        block = self._live.pop(key, None)
        if block is None:
            raise UsageError(f"free of key {key}, which is not allocated (freed twice, or allocated before "
                             "the event stream began).")
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = block.pool
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped == block.mapped:
            self._merge(block, prev, pool)
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped == block.mapped:
            self._merge(block, nxt, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: give back every fully free segment (unmap free pages if expandable)."""
        self._release_cached_blocks()

    def clone(self, capacity_bytes: int | None) -> CachingAllocator:
        """An independent copy of this allocator's state, under ``capacity_bytes`` from now on (no garbage collection:
        ``smallest_fitting_capacity`` resumes capped replays from copies of the uncapped one)."""
        new = copy.copy(self)
        new.capacity_bytes = capacity_bytes
        new._gc = capacity_bytes is not None and self.config.garbage_collection_threshold > 0.0
        new.lowest_refused_bytes = _UNLIMITED
        pools = {id(self._small): _Pool(small=True), id(self._large): _Pool(small=False)}
        old_blocks = [*self._live.values()]
        for pool in (self._small, self._large):
            old_blocks += pool.blocks.values()
            old_blocks += pool.unmapped.values()
        copies: dict[int, _Block] = {}
        for b in old_blocks:
            c = _Block(b.addr, b.size, pools[id(b.pool)], b.seg)  # segments never change: shared
            c.allocated, c.mapped, c.gc_base = b.allocated, b.mapped, b.gc_base
            copies[id(b)] = c
        for b in old_blocks:
            c = copies[id(b)]
            c.prev = None if b.prev is None else copies[id(b.prev)]
            c.next = None if b.next is None else copies[id(b.next)]
        new._live = {key: copies[id(b)] for key, b in self._live.items()}
        for old in (self._small, self._large):
            pool = pools[id(old)]
            pool.keys = list(old.keys)
            pool.blocks = {key: copies[id(b)] for key, b in old.blocks.items()}
            pool.unmapped = {addr: copies[id(b)] for addr, b in old.unmapped.items()}
            pool.gc_calls = old.gc_calls
        new._small, new._large = pools[id(self._small)], pools[id(self._large)]
        return new

    # -- request sizes ------------------------------------------------------------------------------------------

    def _round_size(self, nbytes: int) -> int:
        """round_size: at least 512 B, then a multiple of 512 B or the next power-of-2 division."""
        if nbytes < MIN_BLOCK_SIZE:
            return MIN_BLOCK_SIZE
        if self._any_divisions:
            # roundup_power2_divisions(size): interval index log2(size) - 20, clamped to [0, 15]
            index = min(max(nbytes.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)
            divisions = self._divisions[index]
            if divisions > 1 and nbytes > MIN_BLOCK_SIZE * divisions:
                return _roundup_power2_next_division(nbytes, divisions)
        return -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE

    def _allocation_size(self, size: int) -> int:
        """get_allocation_size: the segment a cudaMalloc would ask for to serve ``size``."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self._large_segment
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    # -- finding a cached block ---------------------------------------------------------------------------------

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """get_free_block: best fit, lower_bound over (size, address), with the max_split_size rules."""
        if self._gc:
            pool.gc_calls += 1  # block reuse interval, tracked only when GC can run
        keys = pool.keys
        i = bisect_left(keys, size * _SPAN)
        if i == len(keys):
            return None
        key = keys[i]
        if self._expandable:
            # Prefer a block that fits without mapping more pages: compare sizes "as expandable", i.e. with the
            # unmapped range that follows (the real loop walks forward while the next is smaller that way).
            blocks = pool.blocks
            block = blocks[key]
            n = len(keys)
            j = i + 1
            while j < n:
                nxt = blocks[keys[j]]
                if _expandable_size(nxt) < _expandable_size(block):
                    block = nxt
                    i = j
                    j += 1
                else:
                    break
            key = keys[i]
        block_size = key // _SPAN
        max_split = self._max_split
        if size < max_split and block_size >= max_split:
            return None  # never hand an oversize block to a request that could split it
        if size >= max_split and block_size >= size + self._max_non_split:
            return None  # an oversize request may round up, but only by max_non_split_rounding
        del keys[i]
        return pool.blocks.pop(key)

    # -- getting new memory -------------------------------------------------------------------------------------

    def _new_block(self, pool: _Pool, size: int) -> _Block:
        """The no-cached-block path of malloc: GC, cudaMalloc, free oversize blocks, free the cache, OOM."""
        alloc_size = self._allocation_size(size)
        if self._gc:
            self._garbage_collect()
        block = self._alloc_block(pool, size, alloc_size, retry=False)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size, alloc_size, retry=False)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, retry=True)
        if block is None:
            self.num_ooms += 1
            raise SimulatedOOM(size, alloc_size, self.reserved_bytes, self.allocated_bytes, self.capacity_bytes)
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, *, retry: bool) -> _Block | None:
        """alloc_block: a new segment of alloc_size (or mapped pages), refused when it would pass the cap."""
        if retry:
            self.num_alloc_retries += 1
        # the cap test uses alloc_size even for expandable segments, which then map only what they need
        request = self.reserved_bytes + alloc_size
        if request > self.highest_request_bytes:
            self.highest_request_bytes = request
        if self.capacity_bytes is not None and request > self.capacity_bytes:
            self.lowest_refused_bytes = min(self.lowest_refused_bytes, request)
            return None
        if self._expandable:
            return self._allocate_expandable(pool, size)
        block = _Block(self._segment_base(alloc_size), alloc_size, pool, None)
        self.num_segments += 1
        self.reserved_bytes += alloc_size
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes
        return block

    def _segment_base(self, alloc_size: int) -> int:
        """The address a cudaMalloc of ``alloc_size`` returns: the real one if known, else below all earlier."""
        index = self._segments_created
        self._segments_created += 1
        if index < len(self._real_addresses):
            return self._real_addresses[index]
        self._next_addr -= -(-alloc_size // ROUND_LARGE) * ROUND_LARGE
        return self._next_addr

    # -- merging and giving memory back -------------------------------------------------------------------------

    @staticmethod
    def _merge(dst: _Block, src: _Block, pool: _Pool) -> None:
        """try_merge_blocks: dst absorbs its free neighbour src (same mapped state, checked by the caller)."""
        if src.mapped:
            pool.remove(src)
        else:
            del pool.unmapped[src.addr]
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _try_merge(self, dst: _Block, src: _Block | None) -> None:
        if src is not None and not src.allocated and src.mapped == dst.mapped:
            self._merge(dst, src, dst.pool)

    def _release_block(self, block: _Block) -> None:
        """release_block: cudaFree a whole cached segment."""
        block.pool.remove(block)
        self.num_segments -= 1
        self.reserved_bytes -= block.size

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks: free oversize cached blocks, just enough for this request."""
        max_split = self._max_split
        if max_split == _UNLIMITED or self._expandable:
            return False  # (expandable blocks cannot be cudaFree'd one by one; the real code asserts)
        target = max(size, max_split)
        keys = pool.keys
        i = bisect_left(keys, target * _SPAN)
        if i < len(keys):
            self._release_block(pool.blocks[keys[i]])
            return True
        # no single block is big enough: free oversize blocks from the largest down
        released = 0
        i -= 1
        while released < target and i >= 0 and keys[i] // _SPAN >= max_split:
            block = pool.blocks[keys[i]]
            released += block.size
            self._release_block(block)
            i -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks: free every cached block that is a whole segment; unmap free pages."""
        for pool in (self._large, self._small):
            to_unmap: list[_Block] = []
            for key in list(pool.keys):
                block = pool.blocks[key]
                if block.seg is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if block.prev is None and block.next is None and not block.mapped:
                    del pool.unmapped[block.addr]  # release_expandable_segment: the whole range is unmapped
                    self.num_segments -= 1

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: above threshold x cap, free whole segments idle longer than average."""
        assert self.capacity_bytes is not None
        threshold = int(self.config.garbage_collection_threshold * self.capacity_bytes)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        pool = self._large
        freeable = [b for b in (pool.blocks[k] for k in pool.keys) if b.prev is None and b.next is None
                    and b.seg is None]
        if not freeable:
            return
        total_age = sum(pool.gc_calls - b.gc_base for b in freeable)
        count = len(freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for key in list(pool.keys):
                block = pool.blocks.get(key)
                if block is None or block.prev is not None or block.next is not None or block.seg is not None:
                    continue
                age = pool.gc_calls - block.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # -- expandable segments ------------------------------------------------------------------------------------

    def _allocate_expandable(self, pool: _Pool, size: int) -> _Block:
        """try_allocate_expandable_block: map pages at the lowest address where ``size`` fits."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped:
            self._map_block(candidate, min(candidate.size, size))
        while candidate.size < size:
            # candidate is free and followed by unmapped space: map some of it, which merges with candidate
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            self._map_block(nxt, min(size - candidate.size, nxt.size))
            candidate = nxt
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """find_expandable_block: lowest-address unmapped range (with a free block just before it) that fits."""
        for addr in sorted(pool.unmapped):
            c = pool.unmapped[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room = 0
            b: _Block | None = c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        va_bytes = -(-_EXPANDABLE_VA_BYTES // page) * page
        self._next_addr -= va_bytes
        segment = _Segment(self._next_addr, page)
        self.num_segments += 1
        candidate = _Block(segment.base, va_bytes, pool, segment)
        candidate.mapped = False
        pool.unmapped[candidate.addr] = candidate
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> None:
        """map_block: back the first ``size`` bytes of an unmapped range with whole pages."""
        segment = to_map.seg
        assert segment is not None and not to_map.mapped
        page = segment.page
        mapped = -(-size // page) * page
        pool = to_map.pool
        del pool.unmapped[to_map.addr]
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, pool, segment)
            rest.mapped = False
            rest.prev = to_map
            rest.next = to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.unmapped[rest.addr] = rest
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        pool.insert(to_map)
        self.reserved_bytes += mapped
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes

    def _unmap_block(self, block: _Block) -> None:
        """unmap_block: give back the whole pages inside a free block; the partial pages at its ends stay."""
        segment = block.seg
        assert segment is not None
        page = segment.page
        offset = block.addr - segment.base
        first = -(-offset // page)
        last = (offset + block.size) // page
        if first >= last:
            return
        pool = block.pool
        pool.remove(block)
        start = segment.base + first * page
        length = (last - first) * page
        before = start - block.addr
        if before > 0:
            head = _Block(block.addr, before, pool, segment)
            head.prev = block.prev
            if block.prev is not None:
                block.prev.next = head
            head.next = block
            block.prev = head
            pool.insert(head)
        after = block.size - before - length
        if after > 0:
            tail = _Block(start + length, after, pool, segment)
            tail.next = block.next
            if block.next is not None:
                block.next.prev = tail
            tail.prev = block
            block.next = tail
            pool.insert(tail)
        block.addr = start
        block.size = length
        block.mapped = False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.unmapped[block.addr] = block
        self.reserved_bytes -= length


def _expandable_size(block: _Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division: e.g. 1200 B with 4 divisions of [1024, 2048) -> 1280 B."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


# -- replaying event streams ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replay(JsonRecord):
    """What the allocator's counters said after an event stream (``replay``)."""

    peak_allocated_bytes: int
    """``torch.cuda.max_memory_allocated()``: peak of the blocks handed out, rounding and unsplit slack included."""
    peak_reserved_bytes: int
    """``torch.cuda.max_memory_reserved()``: peak of the segments held (cudaMalloc'd or mapped)."""
    peak_allocated_index: int
    """Index of the event at which the allocated peak is first reached (0 for an empty stream)."""
    oom_index: int | None
    """Index of the allocation that ran out of memory under the cap; None if the stream fits."""
    num_alloc_retries: int
    """Times the cache was flushed and a cudaMalloc retried (``num_alloc_retries`` in memory_stats())."""


ALLOC = 1
FREE = -1
SOFT_ALLOC = 2  # an allocation whose OOM the caller survives (cuDNN workspace fallback)


def replay(events: Sequence[tuple[int, int, int]] | Iterable[tuple[int, int, int]],
           config: AllocatorConfig = AllocatorConfig(), *, capacity_bytes: int | None = None,
           segment_addresses: Sequence[int] | None = None) -> Replay:
    """Replay an allocation stream through the simulated allocator.

    Args:
        events: ``(op, key, nbytes)``: op +1 allocates ``nbytes`` (the raw request, before rounding) under
            ``key``; op -1 frees ``key`` (nbytes ignored); op +2 is an optional allocation that may fail without
            an OOM (a library workspace: PyTorch's cuDNN code catches the OOM and falls back to an algorithm
            with less workspace), and its free is then ignored. Keys may be reused once freed.
        config: allocator settings.
        capacity_bytes: memory cap (``set_per_process_memory_fraction``); None for no cap.
        segment_addresses: real cudaMalloc segment bases in creation order, when replaying a recorded trace
            (see ``CachingAllocator``); None gives fake addresses, as for any stream without a GPU.

    Returns:
        The peaks, and where the stream ran out of memory under the cap (replay stops there).
    """
    return _replay(events, config, capacity_bytes, segment_addresses)[0]


def _replay(events: Iterable[tuple[int, int, int]], config: AllocatorConfig, capacity_bytes: int | None,
            segment_addresses: Sequence[int] | None, *, start: tuple[int, CachingAllocator] | None = None,
            snapshots: list[tuple[int, int, CachingAllocator]] | None = None,
            every: int = 0) -> tuple[Replay, int]:
    """``replay``, and the allocator's ``lowest_refused_bytes`` at the end. ``start``: (event index, allocator state
    before it) to resume from instead of the first event; ``snapshots``: where to add (event index, highest request
    so far, a copy of the state before it) every ``every`` events (an uncapped replay that capped ones resume from)."""
    if start is None:
        sim = CachingAllocator(config, capacity_bytes=capacity_bytes, segment_addresses=segment_addresses)
        first = 0
    else:
        first, sim = start
    malloc = sim.malloc
    free = sim.free
    peak = 0
    peak_index = 0
    oom_index = None
    skipped: set[int] = set()
    if first:
        events = events[first:] if isinstance(events, Sequence) else list(events)[first:]
    for index, (op, key, nbytes) in enumerate(events, first):
        if snapshots is not None and index % every == 0:
            snapshots.append((index, sim.highest_request_bytes, sim.clone(None)))
        if op == ALLOC or op == SOFT_ALLOC:
            try:
                malloc(key, nbytes)
            except SimulatedOOM:
                if op == SOFT_ALLOC:
                    # the failed attempt already flushed the cache, as the real allocator does before raising
                    skipped.add(key)
                    continue
                oom_index = index
                break
            if sim.allocated_bytes > peak:
                peak = sim.allocated_bytes
                peak_index = index
        elif op == FREE:
            if key in skipped:
                skipped.discard(key)
            else:
                free(key)
        else:
            raise UsageError(f"event {index}: op must be +1 (alloc), +2 (optional alloc) or -1 (free), got {op!r}.")
    return Replay(
        peak_allocated_bytes=sim.peak_allocated_bytes,
        peak_reserved_bytes=sim.peak_reserved_bytes,
        peak_allocated_index=peak_index,
        oom_index=oom_index,
        num_alloc_retries=sim.num_alloc_retries,
    ), sim.lowest_refused_bytes


def smallest_fitting_capacity(events: Sequence[tuple[int, int, int]], config: AllocatorConfig = AllocatorConfig(),
                              *, granularity_bytes: int = 2 * MiB,
                              segment_addresses: Sequence[int] | None = None, fails_at: int = 0) -> int:
    """The smallest memory cap, a multiple of ``granularity_bytes``, at and above which ``events`` replay without OOM.

    This is what ``torch.cuda.set_per_process_memory_fraction(cap / total_memory)`` would need. Under a cap the
    allocator flushes its cache instead of growing, so the answer is usually below the uncapped peak reserved.
    A larger cap can still run out of memory where a smaller one ran: it keeps cached segments that a smaller cap
    would have flushed, later requests split them, and a large request then finds no room (Swin3D-T's H200 stream
    ran under a 6.26 GB cap and ran out under 6.45-6.60 GB). So the bisection's answer is checked from above
    (``_above_every_failing_cap_exactly``): a GPU with more memory than the answer must fit too.
    ``segment_addresses``: as for ``replay`` (a recorded stream's cudaMalloc bases), for every replay it runs.
    ``fails_at``: a cap the caller saw ``events`` run out of memory under: the bisection starts there.
    """
    if granularity_bytes <= 0:
        raise UsageError(f"granularity_bytes must be positive, got {granularity_bytes}.")
    events = events if isinstance(events, Sequence) else list(events)
    runs = _CappedRuns(events, config, segment_addresses, granularity_bytes)
    uncapped = runs.uncapped
    if uncapped.peak_reserved_bytes == 0:
        return 0
    fits = runs.fits

    # Upper end: a cap at or above the uncapped peak reserved never refuses a cudaMalloc, so the capped run is the
    # uncapped one and fits, unless expandable segments test the cap with more than they map, or a cap turns on
    # garbage collection (its threshold is a fraction of the cap): then try it, and grow.
    hi = -(-uncapped.peak_reserved_bytes // granularity_bytes)
    if config.expandable_segments or config.garbage_collection_threshold > 0.0:
        grow = 1
        while not fits(hi):
            hi += grow
            grow *= 2
    top = hi
    # Lower end: reserved never drops below allocated, so a cap under the allocated peak cannot fit.
    lo = max(uncapped.peak_allocated_bytes // granularity_bytes - 1, 0)
    if lo > 0 and fits(lo):
        lo = 0
    lo = max(lo, min(fails_at // granularity_bytes, hi - 1))
    answer = _bisect(fits, lo, hi)
    if config.garbage_collection_threshold > 0.0:
        return _above_every_failing_cap(fits, answer, top) * granularity_bytes
    return _above_every_failing_cap_exactly(runs, answer, top) * granularity_bytes


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The smallest step in (lo, hi] that fits, given that ``lo`` fails (or is 0) and ``hi`` fits, if fitting were
    monotone; it is not always (``smallest_fitting_capacity``)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


class _CappedRuns:
    """Replays of one stream under caps that are multiples of ``granularity_bytes`` (``steps``), remembered as the
    ranges of caps they stand for: a capped replay runs the same under every cap up to the least one that would
    grant a cudaMalloc it refused (``CachingAllocator.lowest_refused_bytes``; not with garbage collection on)."""

    def __init__(self, events: Sequence[tuple[int, int, int]], config: AllocatorConfig,
                 segment_addresses: Sequence[int] | None, granularity_bytes: int) -> None:
        self._events, self._config, self._addresses = events, config, segment_addresses
        self._granularity = granularity_bytes
        self._runs: list[tuple[int, int, bool]] = []  # (first step, first step that may run otherwise, fits)
        # A capped replay is the uncapped one until a cudaMalloc asks for more than the cap: copies of the uncapped
        # allocator along the stream let it start from the last copy before that (none with garbage collection on,
        # whose threshold, a fraction of the cap, acts without a cudaMalloc)
        self._snapshots: list[tuple[int, int, CachingAllocator]] = []
        snapshots = SNAPSHOTS > 0 and config.garbage_collection_threshold == 0.0
        self.uncapped = _replay(events, config, None, segment_addresses, snapshots=self._snapshots if snapshots else None,
                                every=max(len(events) // max(SNAPSHOTS, 1), 1))[0]

    def _start(self, capacity_bytes: int) -> tuple[int, CachingAllocator] | None:
        """The last snapshot that a replay under ``capacity_bytes`` passes through unchanged, as a fresh copy."""
        found = None
        for index, highest, sim in self._snapshots:
            if highest > capacity_bytes:
                break
            found = (index, sim)
        return None if found is None or found[0] == 0 else (found[0], found[1].clone(capacity_bytes))

    def run(self, steps: int) -> tuple[bool, int]:
        """Whether ``steps`` fits, and the first step above it that may run otherwise."""
        for first, changes, fits in self._runs:
            if first <= steps < changes:
                return fits, changes
        capacity = steps * self._granularity
        result, refused = _replay(self._events, self._config, capacity, self._addresses, start=self._start(capacity))
        # with garbage collection on, whose threshold is a fraction of the cap, a run stands for its own cap only
        changes = steps + 1 if self._config.garbage_collection_threshold > 0.0 else max(
            -(-refused // self._granularity), steps + 1)
        self._runs.append((steps, changes, result.oom_index is None))
        return result.oom_index is None, changes

    def fits(self, steps: int) -> bool:
        return self.run(steps)[0]

    @property
    def replays(self) -> int:
        """Capped replays run so far."""
        return len(self._runs)


SNAPSHOTS = 16
"""Copies of the uncapped replay's allocator that capped replays resume from, evenly spaced over the stream: 13-37 %
less time for a whole search on four zoo streams (8k-45k events), the same answers (``tests/test_allocator.py``)."""

WALK_REPLAYS = 16
"""Replays the walk above the bisection's answer may take (``_above_every_failing_cap_exactly``); past them the rest
of the range is probed (``_above_every_failing_cap``). Near the uncapped peak the runs change at nearly every cap (a
small pool's 2 MiB segment refused one cap, granted the next): Swin2SR's stream (45k events) took 48 replays there,
all of which ran, 5.6 s with the bisection on the 2-core CPU (``monotone_caps_zoo_h200_cpu_torch2.14_20261129_s27``)."""


def _above_every_failing_cap_exactly(runs: _CappedRuns, answer: int, top: int) -> int:
    """``answer`` (which fits), raised above every step in (answer, top) that fails: the runs are walked upwards from
    one change to the next, so every cap is covered, at one replay per change (none for those the bisection ran),
    for ``WALK_REPLAYS``; the rest of the range is then probed."""
    step = answer
    fitting: int | None = answer
    start = runs.replays
    while step < top:
        if runs.replays - start == WALK_REPLAYS:
            # the budget is spent: every step from ``fitting`` to here fits (or the one below here failed); probe the
            # rest (the probes below ``step`` are answered by the walk's runs)
            if fitting is None:
                fitting = _bisect(runs.fits, step - 1, top)
            return _above_every_failing_cap(runs.fits, fitting, top)
        fits, changes = runs.run(step)
        if not fits:
            fitting = None
        elif fitting is None:
            fitting = step
        step = changes
    return fitting if fitting is not None else top


ABOVE_PROBES = 12
"""With garbage collection on, the caps tried between the bisection's answer and the uncapped peak reserved, evenly
spaced (then again, closer, below any that fails): out-of-memory windows narrower than the spacing go unseen."""


def _above_every_failing_cap(fits: Callable[[int], bool], answer: int, top: int) -> int:
    """``answer`` (which fits), raised above the highest cap in (answer, top) that fails, as far as ``ABOVE_PROBES``
    evenly spaced caps, and then the same closer below the first that fits above a failure, can tell."""
    while top - answer > 1:
        spacing = max((top - answer) // (ABOVE_PROBES + 1), 1)
        passing = top
        for probe in range(top - spacing, answer, -spacing):  # from the top down: the highest failure first
            if not fits(probe):
                answer = _bisect(fits, probe, passing)
                top = passing
                break
            passing = probe
        else:
            return answer
    return answer
