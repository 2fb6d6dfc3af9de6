"""`fp4attn.KVCache`: a preallocated, quantized K/V cache of one attention layer.

The design follows FlashAttention's `flash_attn_with_kvcache` (a cache preallocated
for a maximum length, per-sequence lengths `cache_seqlens`, new tokens appended in
place before attention) and vLLM's paged layout (a pool of fixed-size pages and a block
table mapping each sequence's i-th page to a page of the pool), because those are the
two forms a serving engine hands an attention kernel:

- contiguous (default): sequence b owns page b of `max_len` tokens; the block table is
  the identity. What `model.generate()` and a static batch want.
- paged (`page_size`, `num_pages`): pages are taken from a free list as sequences
  grow and returned by `reset`; sequences of very different lengths share one pool, and
  `assign_pages` lets an engine place pages itself (a shared prompt prefix).

Both are the same storage, a pool of shape (pages, KV heads, page_size, ...) per
payload tensor (`reference.kvcache`: codes or values, block scales, token scales), and
the same kernels read both through the block table.

K and V each have their own format ("bf16", "fp8", "nvfp4", "mxfp4"); every scale
belongs to one token and one KV head, so a sequence's cache never depends on another
sequence or on tokens that arrive later. `append` checks everything before it writes:
a call that raises leaves the cache as it was.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from fp4attn.reference import robust
from fp4attn.reference.kvcache import (
    CACHE_FORMATS,
    HEAD_DIM_MULTIPLES,
    TokenPayload,
    check_format,
    format_layout,
    quantize_tokens,
    token_values,
)
from fp4attn.routing import decode as decode_routing

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_input(where: str, name: str, t, device: torch.device) -> None:
    """`t` a tensor of an input dtype on the cache's `device`, else the error a caller of
    `where` reads (`KVCache.append`'s keys and values, `decode`'s queries)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{where}: {name} has dtype {t.dtype}; accepted: {INPUT_DTYPES}")
    if t.device != device:
        raise ValueError(f"{where}: {name} is on {t.device}, the cache on {device}")


CONTIGUOUS_ROUND = 256  # the contiguous layout's capacity, rounded up (max_len stays the limit)


@dataclass
class PayloadPool:
    """One format's storage: a pool of pages, (pages, KV heads, page_size, ...)."""

    fmt: str
    data: torch.Tensor  # (P, H, ps, layout.data) uint8, or bfloat16 for "bf16"
    block_scale: torch.Tensor | None  # (P, H, ps, layout.block_scales) uint8
    token_scale: torch.Tensor | None  # (P, H, ps) float32

    @classmethod
    def empty(cls, fmt: str, pages: int, heads: int, page_size: int, head_dim: int, device) -> PayloadPool:
        lay = format_layout(fmt, head_dim)
        shape = (pages, heads, page_size)
        return cls(fmt, torch.zeros(*shape, lay.data, dtype=lay.data_dtype, device=device),
                   torch.zeros(*shape, lay.block_scales, dtype=torch.uint8, device=device) if lay.block_scales else None,
                   torch.zeros(shape, dtype=torch.float32, device=device) if lay.token_scale else None)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        return self.data, self.block_scale, self.token_scale

    def write(self, pages: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor, payload: TokenPayload) -> None:
        # the payload is of the pool's format (`quantize_tokens(rows, self.fmt)`): it has
        # the scales the pool stores
        self.data[pages, heads, slots] = payload.data
        if self.block_scale is not None:
            assert payload.block_scale is not None
            self.block_scale[pages, heads, slots] = payload.block_scale
        if self.token_scale is not None:
            assert payload.token_scale is not None
            self.token_scale[pages, heads, slots] = payload.token_scale

    def read(self, pages: torch.Tensor, slots: torch.Tensor) -> TokenPayload:
        """The payload of tokens at (pages, slots), each (N,), every head: (N * H, ...)."""
        def get(t):
            return None if t is None else t[pages, :, slots].flatten(0, 1)
        return TokenPayload(get(self.data), get(self.block_scale), get(self.token_scale))


@functools.cache
def _kernels():
    """The KV cache's ops, imported at the first kernel append (Triton's import is slow; an
    import statement on every append costs more than the rest of its Python)."""
    from fp4attn.kernels.hopper import decode_op

    return decode_op


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"KVCache: {name}={value!r}; accepted: an int >= {low}")
    return value


def check_head_dim(what: str, head_dim, k_format: str, v_format: str) -> None:
    """Raise ValueError unless a cache of these formats can store `head_dim`: whole
    blocks of each 4-bit format (`HEAD_DIM_MULTIPLES`), the message naming each format's
    multiple."""
    formats = dict.fromkeys((k_format, v_format))
    multiple = max(HEAD_DIM_MULTIPLES[f] for f in formats)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % multiple:
        need = ", ".join(f"{f}: {'any' if HEAD_DIM_MULTIPLES[f] == 1 else f'a multiple of {HEAD_DIM_MULTIPLES[f]}'}"
                         for f in formats)
        raise ValueError(f"{what}: head_dim={head_dim!r} with k_format={k_format!r}, v_format={v_format!r}; "
                         f"accepted: a positive head dim, whole blocks of each format ({need})")


class KVCache:
    """A quantized K/V cache of one attention layer, preallocated for `max_len` tokens
    per sequence.

    Args:
        batch: sequences the cache holds.
        kv_heads: K/V heads (queries may have a multiple of it: GQA).
        head_dim: any for bf16 and fp8, a multiple of 16 with an nvfp4 and of 32 with an
            mxfp4 K or V (whole blocks: `reference.kvcache.HEAD_DIM_MULTIPLES`); the Hopper
            decode kernels take 64 and 128, the reference every other.
        max_len: the most tokens a sequence may hold.
        k_format, v_format: "bf16", "fp8" (e4m3, a float32 scale per token), "nvfp4"
            (E2M1, an E4M3 scale per 16 channels and a float32 scale per token) or
            "mxfp4" (E2M1, an E8M0 scale per 32 channels), each per token and KV head
            (`fp4attn.reference.kvcache`). v_format defaults to k_format.
        device: where the pool lives.
        page_size: None for the contiguous layout; else the paged layout with pages of
            this many tokens.
        num_pages: the pool's pages in the paged layout (default: enough for every
            sequence at max_len).
        rotate_k: store each key rotated along the head dim, H (s * k) (the Hadamard
            rotation of `fp4attn.reference.robust`, stateless, so a growing cache can
            apply it token by token); `fp4attn.decode` rotates the queries the same way
            and divides the softmax scale by the rotation's block, so the scores are the
            same in real arithmetic. It spreads a few large key channels over all of
            them before the 4-bit blocks quantize them (docs/notes/decode.md).
        smooth_k: subtract from every key of a sequence the mean of the keys of its
            first append (its prompt), per KV head and channel, fixed from then on: each
            query's scores move by one constant, which the softmax removes (the
            returned LSE is corrected back), and a shared offset in K no longer takes
            the 4-bit codes' range. A mean over the whole cache would change with every
            token; this one never does.

    Lengths are kept on the device (`lengths`, int32 (batch,), what the kernels read)
    and on the host (`host_lengths`), so that appends are checked without waiting for
    the GPU.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, max_len: int, *, k_format: str = "nvfp4",
                 v_format: str | None = None, device: torch.device | str = "cpu", page_size: int | None = None,
                 num_pages: int | None = None, rotate_k: bool = False, smooth_k: bool = False):
        _check_int("batch", batch, 1)
        _check_int("kv_heads", kv_heads, 1)
        _check_int("max_len", max_len, 1)
        v_format = k_format if v_format is None else v_format
        for name, fmt in (("k_format", k_format), ("v_format", v_format)):
            if fmt not in CACHE_FORMATS:
                raise ValueError(f"KVCache: {name}={fmt!r}; accepted: {CACHE_FORMATS}")
        check_head_dim("KVCache", head_dim, k_format, v_format)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" names the current device; tensors made on it report "cuda:<index>", which
            # the device checks of append and decode compare against
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.batch, self.kv_heads, self.head_dim, self.max_len = batch, kv_heads, head_dim, max_len
        self.k_format, self.v_format = k_format, v_format
        self.rotate_k = bool(rotate_k)
        self.smooth_k = bool(smooth_k)
        # the fixed K mean of each sequence (float32 (batch, kv_heads, head_dim)), set
        # at its first append; zeros before (and without smooth_k)
        self.k_mean = torch.zeros(batch, kv_heads, head_dim, device=self.device)
        if page_size is None:
            if num_pages is not None:
                raise ValueError("KVCache: num_pages is for the paged layout; pass page_size too")
            # one page per sequence, its rows rounded up to a multiple of CONTIGUOUS_ROUND so
            # that the decode kernel's key tiles never straddle the end of a page
            self.paged, self.num_pages = False, batch
            self.page_size = -(-max_len // CONTIGUOUS_ROUND) * CONTIGUOUS_ROUND
            table = torch.arange(batch, dtype=torch.int32).reshape(batch, 1)
        else:
            _check_int("page_size", page_size, 1)
            pages_per_seq = math.ceil(max_len / page_size)
            num_pages = batch * pages_per_seq if num_pages is None else _check_int("num_pages", num_pages, 1)
            self.paged, self.page_size, self.num_pages = True, page_size, num_pages
            table = torch.full((batch, pages_per_seq), -1, dtype=torch.int32)
            self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
            self._owner = [-1] * num_pages  # the sequence a page was assigned to (-1: free)
        self._host_table = table
        self.block_table = table.to(self.device)
        self.host_lengths = [0] * batch
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.k = PayloadPool.empty(k_format, self.num_pages, kv_heads, self.page_size, head_dim, self.device)
        self.v = PayloadPool.empty(v_format, self.num_pages, kv_heads, self.page_size, head_dim, self.device)
        self._op_operands: tuple | None = None  # the pools as the kernels' ops take them (decode_op.cache_operands)

    # ------------------------------------------------------------------ inspection
    def __repr__(self) -> str:
        layout = f"paged {self.num_pages} x {self.page_size}" if self.paged else "contiguous"
        rot = (", rotate_k" if self.rotate_k else "") + (", smooth_k" if self.smooth_k else "")
        return (f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"max_len={self.max_len}, k={self.k_format}, v={self.v_format}{rot}, {layout}, device={self.device})")

    def bytes_per_token(self) -> int:
        """Bytes of K and V one token of one sequence takes, over all KV heads."""
        return self.kv_heads * (format_layout(self.k_format, self.head_dim).bytes_per_token()
                                + format_layout(self.v_format, self.head_dim).bytes_per_token())

    def max_length(self) -> int:
        """The longest sequence held now (host-side, no synchronization)."""
        return max(self.host_lengths)

    # ------------------------------------------------------------------ writing
    def append(self, k: torch.Tensor, v: torch.Tensor, counts=None) -> None:
        """Quantize and write new tokens after each sequence's current ones.

        Args:
            k, v: (batch, kv_heads, S_new, head_dim), bfloat16, float16 or float32, on
                the cache's device.
            counts: None (every sequence takes all S_new tokens), or one int per
                sequence in [0, S_new] (a list, tuple or CPU tensor): sequence b takes
                its first counts[b] tokens (the rest is padding and is not read).

        Raises ValueError/TypeError, and changes nothing, when the shapes, dtypes or
        devices do not match the cache or a sequence would exceed max_len (or the
        paged pool has too few free pages); an error while writing leaves the cache as
        it was too (its lengths and pages).
        """
        self._append(k, v, counts)

    def _append(self, k, v, counts) -> tuple[list[int], list[tuple[int, int]]] | None:
        """`append`; returns what `_undo` needs to take it back (None: nothing appended)."""
        every = counts is None  # every sequence takes all the new tokens
        counts = self._check_append(k, v, counts)
        if not any(counts):
            return None
        new_pages = self._pages_for(counts)  # may raise: before anything is written
        if self.smooth_k:
            k = self._smoothed(k, counts)
        if self.rotate_k:
            k = robust.rotate(k)
        starts = list(self.host_lengths)
        undo = (starts, new_pages)
        self._commit_pages(new_pages)
        try:
            backend = decode_routing.append_route(self.device, self.head_dim)[0]
            if backend == "triton":
                uniform = every or all(c == k.shape[2] for c in counts)
                _kernels().hopper_append(self, k, v, None if uniform else counts)
            else:
                self._append_reference(k, v, counts, starts)
        except BaseException:
            self._undo(undo)
            raise
        self.host_lengths[:] = [n + c for n, c in zip(starts, counts)]
        if backend != "triton":
            self.lengths.copy_(torch.tensor(self.host_lengths, dtype=torch.int32))
        return undo

    def _undo(self, undo: tuple[list[int], list[tuple[int, int]]] | None) -> None:
        """Take an `_append` back: the lengths before it, its new pages back to the free
        list (the bytes it wrote past those lengths are never read). A sequence it had
        started keeps the K mean it set, which its next first append sets again."""
        if undo is None:
            return
        starts, pages = undo
        for b, i in reversed(pages):
            page = int(self._host_table[b, i])
            self._host_table[b, i] = -1
            self._owner[page] = -1
            self._free.append(page)
        if pages:
            self._sync_table()
        self.host_lengths[:] = starts
        self.lengths.copy_(torch.tensor(starts, dtype=torch.int32))

    def _smoothed(self, k: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """k less each sequence's fixed mean, which a sequence's first append sets from
        its own tokens (float64 sums, the mean rounded to float32)."""
        first = [b for b, c in enumerate(counts) if c and not self.host_lengths[b]]
        for b in first:
            self.k_mean[b] = k[b, :, :counts[b]].double().mean(dim=1).float()
        return k.float() - self.k_mean[:, :, None, :]

    def _check_append(self, k, v, counts) -> list[int]:
        for name, t in (("k", k), ("v", v)):
            check_input("KVCache.append", name, t, self.device)
            if t.ndim != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (self.batch, self.kv_heads, self.head_dim):
                raise ValueError(f"KVCache.append: {name} has shape {tuple(t.shape)}; accepted: (batch={self.batch}, "
                                 f"kv_heads={self.kv_heads}, new tokens, head_dim={self.head_dim})")
        if k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(f"KVCache.append: k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must "
                             "match in shape and dtype")
        s_new = k.shape[2]
        if counts is None:
            counts = [s_new] * self.batch
        else:
            if isinstance(counts, torch.Tensor):
                if counts.device.type != "cpu":
                    raise ValueError("KVCache.append: counts must be on the host (a list, tuple or CPU tensor): the "
                                     "cache checks them against max_len before it writes")
                counts = counts.tolist()
            counts = list(counts)
            if len(counts) != self.batch or any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
                raise ValueError(f"KVCache.append: counts={counts!r}; accepted: {self.batch} ints, one per sequence")
            if any(not 0 <= c <= s_new for c in counts):
                raise ValueError(f"KVCache.append: counts={counts} must lie in [0, {s_new}] (the new tokens given)")
        over = [b for b, c in enumerate(counts) if self.host_lengths[b] + c > self.max_len]
        if over:
            b = over[0]
            raise ValueError(f"KVCache.append: sequence {b} holds {self.host_lengths[b]} tokens and would take "
                             f"{counts[b]} more, beyond max_len={self.max_len}; accepted: at most "
                             f"{self.max_len - self.host_lengths[b]} more")
        return counts

    def _pages_for(self, counts: list[int]) -> list[tuple[int, int]]:
        """The (sequence, page index in its table) pairs that need a page for this append."""
        if not self.paged:
            return []
        need = []
        for b, c in enumerate(counts):
            first = math.ceil(self.host_lengths[b] / self.page_size)
            last = math.ceil((self.host_lengths[b] + c) / self.page_size)
            need += [(b, i) for i in range(first, last) if self._host_table[b, i] < 0]
        if len(need) > len(self._free):
            raise ValueError(f"KVCache.append: needs {len(need)} new pages, the pool has {len(self._free)} free of "
                             f"{self.num_pages}; accepted: appends that fit the free pages (reset finished sequences, "
                             "or build the cache with more num_pages)")
        return need

    def _commit_pages(self, need: list[tuple[int, int]]) -> None:
        if not need:
            return
        for b, i in need:
            page = self._free.pop()
            self._owner[page] = b
            self._host_table[b, i] = page
        self._sync_table()

    def _sync_table(self) -> None:
        # a pinned, asynchronous copy: a copy from pageable memory would wait for the GPU
        src = self._host_table.pin_memory() if self.device.type == "cuda" else self._host_table
        self.block_table.copy_(src, non_blocking=self.device.type == "cuda")

    def _append_reference(self, k, v, counts, starts) -> None:
        """The reference write: every new token quantized by `reference.kvcache`."""
        b_idx, s_idx = [], []
        for b, c in enumerate(counts):
            b_idx += [b] * c
            s_idx += list(range(c))
        dev = self.device
        b_t = torch.tensor(b_idx, device=dev)
        s_t = torch.tensor(s_idx, device=dev)
        pos = torch.tensor(starts, device=dev)[b_t] + s_t
        table = self._host_table.to(dev).long()
        pages = table[b_t, pos // self.page_size]
        slots = pos % self.page_size
        n, h = len(b_idx), self.kv_heads
        heads = torch.arange(h, device=dev).repeat(n)
        pages, slots = pages.repeat_interleave(h), slots.repeat_interleave(h)
        for pool, x in ((self.k, k), (self.v, v)):
            rows = x[b_t, :, s_t].reshape(n * h, self.head_dim)  # (n, H, D) -> token-major, head within
            pool.write(pages, heads, slots, quantize_tokens(rows, pool.fmt))

    # ------------------------------------------------------------------ pages
    def assign_pages(self, batch_index: int, pages, length: int) -> None:
        """Paged layout: make sequence `batch_index` (now empty) hold `length` tokens in
        the given pool pages, in order (pages written through another sequence, e.g. a
        shared prompt prefix; they stay the first owner's, so `reset` of this sequence
        does not free them). The next append continues after `length`."""
        if not self.paged:
            raise ValueError("KVCache.assign_pages is for the paged layout (build the cache with page_size)")
        b = _check_int("batch_index", batch_index, 0)
        if b >= self.batch:
            raise ValueError(f"KVCache.assign_pages: batch_index={b}; accepted: [0, {self.batch - 1}]")
        if self.host_lengths[b]:
            raise ValueError(f"KVCache.assign_pages: sequence {b} holds {self.host_lengths[b]} tokens; reset it first")
        pages = [int(p) for p in pages]
        _check_int("length", length, 0)
        if length > self.max_len or math.ceil(length / self.page_size) != len(pages):
            raise ValueError(f"KVCache.assign_pages: {len(pages)} pages of {self.page_size} tokens cannot hold "
                             f"length={length} exactly (max_len {self.max_len})")
        bad = [p for p in pages if not 0 <= p < self.num_pages or self._owner[p] < 0]
        if bad:
            raise ValueError(f"KVCache.assign_pages: pages {bad} are out of range or unused; accepted: pages in "
                             f"[0, {self.num_pages - 1}] that hold tokens")
        self._host_table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.host_lengths[b] = length
        self.lengths[b] = length
        self._sync_table()

    def reset(self, batch_index: int | None = None) -> None:
        """Empty one sequence (or all): its length goes to 0 and, in the paged layout,
        the pages it took return to the pool. The bytes are left as they are: nothing
        reads past a sequence's length."""
        seqs = range(self.batch) if batch_index is None else [batch_index]
        for b in seqs:
            if not 0 <= b < self.batch:
                raise ValueError(f"KVCache.reset: batch_index={b}; accepted: [0, {self.batch - 1}] or None")
            if self.paged:
                for i in range(self._host_table.shape[1]):
                    p = int(self._host_table[b, i])
                    if p >= 0 and self._owner[p] == b:
                        self._owner[p] = -1
                        self._free.append(p)
                    self._host_table[b, i] = -1
            self.host_lengths[b] = 0
            self.k_mean[b] = 0.0
        if self.paged:
            self._sync_table()
        self.lengths.copy_(torch.tensor(self.host_lengths, dtype=torch.int32))

    # ------------------------------------------------------------------ reading
    def token_positions(self, max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages, slots), int64 (batch, N), of each sequence's tokens 0 .. N - 1 (N =
        `max_tokens` or the longest length); entries past a sequence's length point at
        page 0, slot 0."""
        n = self.max_length() if max_tokens is None else max_tokens
        j = torch.arange(n, device=self.device)
        inside = j[None, :] < torch.tensor(self.host_lengths, device=self.device)[:, None]
        table = self._host_table.to(self.device).long()
        pages = table.gather(1, (j // self.page_size).clamp(max=table.shape[1] - 1).expand(self.batch, n))
        pages = torch.where(inside, pages.clamp(min=0), 0)
        return pages, torch.where(inside, j % self.page_size, 0)

    def reference_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kb, ks, vb, vs): the cached tokens as block values (float32 (batch, kv_heads,
        N, head_dim)) and token scales (float32 (batch, kv_heads, N)), N the longest
        length; zeros past each sequence's length. What `reference.decode` reads."""
        pages, slots = self.token_positions()
        b, n, h, d = self.batch, pages.shape[1], self.kv_heads, self.head_dim
        inside = torch.arange(n, device=self.device)[None, :] < torch.tensor(self.host_lengths,
                                                                             device=self.device)[:, None]
        out: list[torch.Tensor] = []
        for pool in (self.k, self.v):
            vals, scales = token_values(pool.read(pages.flatten(), slots.flatten()), pool.fmt, d)
            vals = vals.reshape(b, n, h, d).transpose(1, 2)
            scales = scales.reshape(b, n, h).transpose(1, 2)
            keep = inside[:, None, :]
            out += [torch.where(keep[..., None], vals, 0.0), torch.where(keep, scales, 0.0)]
        kb, ks, vb, vs = out
        return kb, ks, vb, vs

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) as the values they stand for, float32 (batch, kv_heads, N, head_dim),
        zeros past each sequence's length (k smoothed and rotated where `smooth_k`,
        `rotate_k` say): for tests and
        inspection (decode never makes this copy)."""
        kb, ks, vb, vs = self.reference_operands()
        return kb * ks[..., None], vb * vs[..., None]


__all__ = ["KVCache", "check_format"]
