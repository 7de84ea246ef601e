"""A few rows times the int4 weights MSLK holds: a Triton GEMV over MSLK's own packed copy.

MSLK's CUTLASS GEMM (mslk_int4) is the fastest int4 product here from about sixteen rows up and
at prefill, but its tiles are made for many rows: at one to eight, a decode step's, it was
slower than gemlite's GEMV on every linear shape of the 7B and at times slower than bf16
(BENCHMARKS.md, "int4-wo's numbers through MSLK's CUTLASS kernel"). MSLK has no GEMV, gemlite's
cannot read MSLK's copy, and a second packed copy would double the weights' memory: so this
kernel reads MSLK's copy itself.

The copy's order (LAYOUT; mslk_layout reads MSLK's off its preshuffle and the kernel is used
only where the two are the same): atoms of 16 rows x 16 inputs, one after another down the rows
first, then along the inputs; in an atom, 32-bit word 4 * t1 + t0 (t1 < 8, t0 < 4) holds the 8
weights of rows t1 and t1 + 8 at inputs 2 t0, 2 t0 + 1, 2 t0 + 8 and 2 t0 + 9, its nibble
v_r + 2 v8 + 4 v1 the weight at row t1 + 8 v_r and input 2 t0 + v1 + 8 v8 (the values one thread
of a Hopper tensor-core instruction holds, side by side). So the kernel loads whole words, and
each of a word's 8 nibbles meets one of four slices of x and adds into one of two rows.

The numbers (mslk_int4): nibble q ^ 8 (q - 8 as 4-bit two's complement), scales and zero points
[K/group, N] bf16, w = (q - 8) * scale + zero. Within a group that is 16 s f + (z - 24 s) with
f = 1 + q / 16: a nibble becomes f by OR-ing it into the mantissa of 1.0 (a conversion
instruction runs at a quarter of the FMA rate), each weight costs a shift, a mask and one FMA a
row, and the scale and zero point are applied once per output and chunk of a group. Each program
computes BLOCK_N outputs over its share of the chunks, BLOCK_K inputs a step (SPLIT_K shares).
More than one share are summed by atomic adds into an fp32 workspace, and the program that adds
the last share of its outputs (a count per block of outputs says which) writes them into the
output in x's dtype and leaves the workspace and count zeroed for the next call: added up in
bf16, as gemlite's GEMV does, the hundreds of shares of the down projection's inputs at one
chunk a program missed the load's check (each add rounds to the running sum's 8 bits;
BENCHMARKS.md), and an fp32 output cost a zeroing kernel before each product and a cast after.
One row takes the FMA kernel (_kernel); two rows and more the tensor-core one (_rows_kernel),
which makes the same f and multiplies it by tl.dot, so that another row costs no more work per
weight, or, where the launch says so, the FMA kernel with every row's sums in registers (each
weight unpacked once, then an FMA a row: for up to FMA_ROWS, where MSLK's tiles are the least
filled; the search decides).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from .mslk_layout import Layout

MOST_ROWS = 32  # MSLK's GEMM, made for many rows, serves more (a search decides up to where)
FMA_ROWS = 8  # the FMA kernel holds every row's sums in registers: a few rows at most


def _hopper_atom() -> Layout:
    """The layout of the module doc as mslk_layout writes it (table[r * 16 + c] = nibble)."""
    table = [8 * (4 * (r % 8) + (c % 8) // 2) + r // 8 + 2 * (c // 8) + 4 * (c % 2)
             for r in range(16) for c in range(16)]
    return Layout(16, 16, True, tuple(table))


LAYOUT = _hopper_atom()
# 1.0f's bits, passed to the kernel as an argument: as a constant, the compiler kept the mask and
# this OR as two instructions (a GPU instruction takes one constant), as a value one LOP3 does both.
ONE_BITS = 0x3F800000


def pack(q: torch.Tensor) -> torch.Tensor:
    """The app's int4 numbers q (uint8 [N, K] in 0..15) as the copy in LAYOUT: int8 [N, K/2],
    each nibble q ^ 8 as MSLK's. One reshape and permute on q's device, so a load can pack
    without MSLK (whose wheel needs one torch version); mslk_layout.shuffle gives the same
    through a positions tensor too big for a 7B layer."""
    n, k = q.shape
    if n % 16 or k % 16:
        raise ValueError(f"an int4 weight of {n}x{k} is not whole 16x16 atoms")
    # weight (n, k) = (16 an + 8 v_r + t1, 16 ak + 8 v8 + 2 t0 + v1) goes to word
    # (ak * N/16 + an) * 32 + 4 t1 + t0, nibble v_r + 2 v8 + 4 v1 (the fastest last)
    nibbles = (q ^ 8).reshape(n // 16, 2, 8, k // 16, 2, 4, 2)  # an, v_r, t1, ak, v8, t0, v1
    nibbles = nibbles.permute(3, 0, 2, 5, 6, 4, 1).reshape(-1, 2)  # ak, an, t1, t0, v1, v8, v_r
    return (nibbles[:, 0] | nibbles[:, 1] << 4).view(torch.int8).reshape(n, k // 2)



# the kernels' jitted helpers: Triton finds a kernel's callees among its globals
_as_float = _last_share = _collect = None


def _define_helpers() -> None:
    """Triton is imported here, not with the module: the app imports this module off a GPU."""
    global _as_float, _last_share, _collect
    if _as_float is not None:
        return
    import triton
    import triton.language as tl

    # Triton's interpreter looks for triton.language among a jitted function's module globals
    # when another module's kernel calls it (mslk_rows calls last_share and collect)
    globals()["tl"] = tl

    @triton.jit
    def as_float(word, P: tl.constexpr, one_bits):
        """Nibble P of each word (q, 0..15) as the float 1 + q / 16: moved to the mantissa's
        top bits 19-22 and OR-ed into 1.0's bits (no conversion instruction)."""
        if 4 * P <= 19:
            bits = (word << (19 - 4 * P)) & 0x780000
        else:
            bits = (word >> (4 * P - 19)) & 0x780000
        return (bits | one_bits).to(tl.float32, bitcast=True)

    @triton.jit
    def last_share(count_at, SPLIT_K: tl.constexpr):
        """After a program added its share of its outputs into the fp32 workspace: whether it
        was the last of the SPLIT_K to (the count of shares in, reset by the last)."""
        tl.debug_barrier()  # every thread's adds issued before the count is raised
        done = tl.atomic_add(count_at, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            tl.atomic_xchg(count_at, 0)
        return done == SPLIT_K - 1

    @triton.jit
    def collect(space_at, out_at, ok):
        """The last share's program: the summed outputs out of the workspace (left zeroed
        for the next call) into the output, in its dtype."""
        # read where the adds were made (L2), past this program's own cache
        total = tl.atomic_add(space_at, tl.zeros(space_at.shape, tl.float32), mask=ok,
                              sem="relaxed")
        tl.store(out_at, total.to(out_at.dtype.element_ty), mask=ok)
        tl.store(space_at, tl.zeros(space_at.shape, tl.float32), mask=ok)

    _as_float, _last_share, _collect = as_float, last_share, collect


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    _define_helpers()

    @triton.jit
    def gemv(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, space_ptr, count_ptr, M, N, K, stride_xm,
             one_bits, GROUP: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SPLIT_K: tl.constexpr, CHUNK: tl.constexpr):
        R8: tl.constexpr = BLOCK_N // 2  # (atom, t1) pairs: each word row serves two outputs
        KB: tl.constexpr = BLOCK_K // 16  # atoms along the inputs in a step
        pair = tl.program_id(0) * R8 + tl.arange(0, R8)  # over the whole N: atom * 8 + t1
        row0 = (pair // 8) * 16 + pair % 8  # the outputs of nibbles with v_r = 0, and + 8
        ok = row0 < N
        kt = tl.arange(0, KB)
        t0 = tl.arange(0, 4)
        m = tl.arange(0, BLOCK_M)
        # words of a step [1, KB, R8, 4] (4-D like the products, so that no nibble's values
        # change layout in the loop): atom (kt, n // 16) starts at word (kt * N/16 + n/16) * 32
        words = (kt[None, :, None, None] * (N // 16) * 32 + (pair // 8)[None, None, :, None] * 32
                 + (pair % 8)[None, None, :, None] * 4 + t0[None, None, None, :])
        word_ok = ok[None, None, :, None]
        step_words = KB * (N // 16) * 32
        # x at input 16 kt + 2 t0 (+ v1 + 8 v8), for each row: [BLOCK_M, KB, 1, 4]
        x_at = (m[:, None, None, None] * stride_xm + kt[None, :, None, None] * 16
                + t0[None, None, None, :] * 2)
        m_ok = (m < M)[:, None, None, None]
        # A chunk (CHUNK inputs, within one group) is summed before its scale is applied; its
        # steps are unrolled, so a program whose share is one chunk, as gemlite's GEMV does it,
        # issues all its loads at once and loops not at all.
        chunks = K // CHUNK
        per_split = tl.cdiv(chunks, SPLIT_K)
        first = tl.program_id(1) * per_split
        last = tl.minimum(first + per_split, chunks)
        y0 = tl.zeros([BLOCK_M, R8], dtype=tl.float32)
        y1 = tl.zeros([BLOCK_M, R8], dtype=tl.float32)
        for chunk in range(first, last):
            # In a group w = (q - 8) s + z = 16 s f + (z - 24 s) with f = 1 + q / 16, a float
            # made by OR-ing q into the mantissa of 1.0 (no conversion instruction): the
            # products f x are summed over the chunk, then scaled once per output.
            group = chunk * CHUNK // GROUP
            a0 = tl.zeros([BLOCK_M, KB, R8, 4], dtype=tl.float32)
            a1 = tl.zeros([BLOCK_M, KB, R8, 4], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_M, KB, 1, 4], dtype=tl.float32)
            for step in tl.static_range(CHUNK // BLOCK_K):
                k0 = chunk * CHUNK + step * BLOCK_K
                # XOR with 0x88888888 gives every nibble back as q (0..15), the app's own
                # (read once: kept out of L2's way of x, which every program reads)
                word = tl.load(w_ptr + (k0 // BLOCK_K) * step_words + words, mask=word_ok,
                               other=0, eviction_policy="evict_first") ^ -2004318072
                x_here = x_ptr + k0 + x_at
                x00 = tl.load(x_here, mask=m_ok, other=0.0).to(tl.float32)  # v8 = 0, v1 = 0
                x01 = tl.load(x_here + 1, mask=m_ok, other=0.0).to(tl.float32)
                x10 = tl.load(x_here + 8, mask=m_ok, other=0.0).to(tl.float32)
                x11 = tl.load(x_here + 9, mask=m_ok, other=0.0).to(tl.float32)
                x_sum += (x00 + x01) + (x10 + x11)
                for p in tl.static_range(8):
                    f = _as_float(word, p, one_bits)
                    if p // 4 == 0:
                        x = x00 if (p // 2) % 2 == 0 else x10
                    else:
                        x = x01 if (p // 2) % 2 == 0 else x11
                    if p % 2 == 0:
                        a0 += f * x
                    else:
                        a1 += f * x
            s0 = tl.load(s_ptr + group * N + row0, mask=ok, other=0.0).to(tl.float32)
            z0 = tl.load(z_ptr + group * N + row0, mask=ok, other=0.0).to(tl.float32)
            s1 = tl.load(s_ptr + group * N + row0 + 8, mask=ok, other=0.0).to(tl.float32)
            z1 = tl.load(z_ptr + group * N + row0 + 8, mask=ok, other=0.0).to(tl.float32)
            xs = tl.sum(tl.sum(x_sum, axis=3), axis=1)  # [BLOCK_M, 1]
            y0 += (tl.sum(tl.sum(a0, axis=3), axis=1) * (16.0 * s0)[None, :]
                   + xs * (z0 - 24.0 * s0)[None, :])
            y1 += (tl.sum(tl.sum(a1, axis=3), axis=1) * (16.0 * s1)[None, :]
                   + xs * (z1 - 24.0 * s1)[None, :])
        at = m[:, None] * N + row0[None, :]
        store_ok = (m < M)[:, None] & ok[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr + at, y0.to(y_ptr.dtype.element_ty), mask=store_ok)
            tl.store(y_ptr + at + 8, y1.to(y_ptr.dtype.element_ty), mask=store_ok)
        else:  # the shares summed in fp32 (module doc), the last one's program writes them
            tl.atomic_add(space_ptr + at, y0, mask=store_ok, sem="relaxed")
            tl.atomic_add(space_ptr + at + 8, y1, mask=store_ok, sem="relaxed")
            if _last_share(count_ptr + tl.program_id(0), SPLIT_K):
                _collect(space_ptr + at, y_ptr + at, store_ok)
                _collect(space_ptr + at + 8, y_ptr + at + 8, store_ok)

    return gemv


@functools.cache
def _rows_kernel():
    """Two to MOST_ROWS rows through tensor cores: a step's 8 nibble slices are joined into the
    [BLOCK_K, BLOCK_N] operand of tl.dot. Its inputs come out in their natural order (16 kt +
    8 v8 + 2 t0 + v1), so x is read as it lies; its outputs in the order (pair, v_r), which the
    scales and the store follow. The f of a nibble (1 + q / 16) is exact in bf16."""
    import triton
    import triton.language as tl

    _define_helpers()

    @triton.jit
    def rows(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, space_ptr, count_ptr, M, N, K, stride_xm,
             one_bits, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, CHUNK: tl.constexpr):
        R8: tl.constexpr = BLOCK_N // 2
        KB: tl.constexpr = BLOCK_K // 16
        pair = tl.program_id(0) * R8 + tl.arange(0, R8)
        kt = tl.arange(0, KB)
        t0 = tl.arange(0, 4)
        words = (kt[:, None, None] * (N // 16) * 32 + (pair // 8)[None, :, None] * 32
                 + (pair % 8)[None, :, None] * 4 + t0[None, None, :])  # [KB, R8, 4]
        word_ok = ((pair // 8) * 16 < N)[None, :, None]
        step_words = KB * (N // 16) * 32
        m = tl.arange(0, BLOCK_M)
        x_at = m[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
        m_ok = (m < M)[:, None]
        column = tl.arange(0, BLOCK_N)  # the product's column: local pair * 2 + v_r
        out_pair = tl.program_id(0) * R8 + column // 2
        row = (out_pair // 8) * 16 + 8 * (column % 2) + out_pair % 8
        row_ok = row < N
        chunks = K // CHUNK  # as in the one-row kernel
        per_split = tl.cdiv(chunks, SPLIT_K)
        first = tl.program_id(1) * per_split
        last = tl.minimum(first + per_split, chunks)
        y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for chunk in range(first, last):
            group = chunk * CHUNK // GROUP
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)  # summed across at the end
            for step in tl.static_range(CHUNK // BLOCK_K):
                k0 = chunk * CHUNK + step * BLOCK_K
                word = tl.load(w_ptr + (k0 // BLOCK_K) * step_words + words, mask=word_ok,
                               other=0, eviction_policy="evict_first") ^ -2004318072
                x = tl.load(x_ptr + k0 + x_at, mask=m_ok, other=0.0)
                x_sum += x.to(tl.float32)
                # nibble p = v_r + 2 v8 + 4 v1, joined into [KB, R8, t0, v_r, v8, v1]
                low = tl.join(tl.join(_as_float(word, 0, one_bits), _as_float(word, 1, one_bits)),
                              tl.join(_as_float(word, 2, one_bits), _as_float(word, 3, one_bits)))
                high = tl.join(tl.join(_as_float(word, 4, one_bits),
                                       _as_float(word, 5, one_bits)),
                               tl.join(_as_float(word, 6, one_bits),
                                       _as_float(word, 7, one_bits)))
                f = tl.permute(tl.join(low, high), (0, 4, 2, 5, 1, 3))  # (kt, v8, t0, v1), (R8, v_r)
                acc = tl.dot(x, f.reshape(BLOCK_K, BLOCK_N).to(x.dtype), acc)
            s = tl.load(s_ptr + group * N + row, mask=row_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + group * N + row, mask=row_ok, other=0.0).to(tl.float32)
            y += (acc * (16.0 * s)[None, :]
                  + tl.sum(x_sum, axis=1)[:, None] * (z - 24.0 * s)[None, :])
        at = m[:, None] * N + row[None, :]
        store_ok = m_ok & row_ok[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=store_ok)
        else:
            tl.atomic_add(space_ptr + at, y, mask=store_ok, sem="relaxed")
            if _last_share(count_ptr + tl.program_id(0), SPLIT_K):
                _collect(space_ptr + at, y_ptr + at, store_ok)

    return rows


# Launches (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, CHUNK]) by GPU, weight shape and
# row count: the fastest `benchmarks/int4_kernels.py --gemv-search` found (CONFIGS_FILE: {GPU
# name: {"NxK": {"1": [...], "8": [...], "gemv_rows": n}}}, launches by row count); the nearest
# searched row count at or above a call's, else DEFAULT's. "gemv_rows": up to how many rows the
# GEMV beat MSLK's GEMM there (most_rows). A GPU the file does not name borrows another's
# entry for the shape (the kernel is the same on every Hopper GPU; the best launch may differ
# a little). No tuning at load: a switch waits for none.
# CHUNK: inputs summed before a scale (a divisor of the group; the group when left out);
# SPLIT_K: shares of the chunks, 0 for one program a chunk; a 7th value of 1: a few rows through
# the FMA kernel, each weight unpacked once for all of them, instead of tensor cores.
CONFIGS_FILE = Path(__file__).with_name("mslk_gemv_configs.json")
# for a shape searched on no GPU: one program a chunk at one row (the fastest on every 7B shape
# on an H100), four shares of the groups from two rows
DEFAULT = {1: (256, 32, 0, 4, 1, 64), MOST_ROWS: (128, 32, 4, 4, 2)}
# K splits by groups of 128 inputs: the 7B's 3584 inputs are 28 groups, its down projection's
# 148. The last launches are gemlite's GEMV's shape of work: many outputs over 64 or 128 inputs
# a program, no loop.
SEARCHED = [(block_n, block_k, split_k, 4, 2) for block_n in (32, 64, 128, 256)
            for block_k in (32, 64) for split_k in (1, 4, 14)] + [
    (64, 64, 28, 2, 1), (128, 32, 28, 4, 1), (32, 64, 28, 1, 1), (256, 64, 8, 4, 2),
    (128, 64, 8, 2, 2), (64, 32, 14, 2, 2)] + [
    (block_n, block_k, 0, 4, 1, chunk) for block_n in (128, 256, 512)
    for block_k, chunk in ((32, 64), (64, 64), (64, 128))] + [
    (512, 32, 0, 8, 1, 64), (256, 32, 0, 2, 1, 64)] + [
    (block_n, block_k, 0, 4, 1, 64, 1) for block_n in (32, 64, 128) for block_k in (32, 64)] + [
    (64, 32, 4, 4, 2, 128, 1), (128, 32, 14, 4, 2, 128, 1)]


@functools.cache
def _shape_configs(gpu: str, shape: str) -> dict:
    """This GPU's entry of CONFIGS_FILE for the shape ("NxK"), else the first other GPU's."""
    found = json.loads(CONFIGS_FILE.read_text()) if CONFIGS_FILE.exists() else {}
    if shape in found.get(gpu, {}):
        return found[gpu][shape]
    return next((entries[shape] for _, entries in sorted(found.items()) if shape in entries), {})


def config(n: int, k: int, rows: int, device: torch.device) -> tuple[int, ...]:
    by_rows = _shape_configs(torch.cuda.get_device_name(device), f"{n}x{k}")
    fitting = sorted(int(r) for r in by_rows if r.isdigit() and int(r) >= rows)
    if fitting:
        return tuple(by_rows[str(fitting[0])])
    return DEFAULT[1 if rows == 1 else MOST_ROWS]


def most_rows(n: int, k: int, device: torch.device) -> int:
    """Up to how many rows the GEMV serves an [n, k] weight on this GPU: as measured against
    MSLK's GEMM for the shape, else one row (a decode step of one reply, where MSLK's tiles
    lose the most)."""
    found = _shape_configs(torch.cuda.get_device_name(device), f"{n}x{k}")
    return int(found.get("gemv_rows", 1))


def workspace(rows: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What a product of up to `rows` rows by an [n, K] weight sums its shares in: (fp32
    [rows, n], a count per block of outputs), zeroed, and zeroed again by every product that
    used it. One per layer: two products running at once must not share one."""
    return (torch.zeros(rows, n, dtype=torch.float32, device=device),
            torch.zeros(max(n // 16, 1), dtype=torch.int32, device=device))


def gemv(x2: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
         launch: tuple[int, ...] | None = None,
         space: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x2 [M, K] (M <= MOST_ROWS) @ the weight [N, K/2] MSLK's copy holds in LAYOUT (module
    doc).T: [M, N] in x2's dtype. `launch`: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps,
    num_stages[, CHUNK[, FMA]]) instead of config()'s; `space`: the layer's workspace() (a
    new one when left out)."""
    rows, k = x2.shape
    n, groups = weight.shape[0], scales.shape[0]
    if (rows > MOST_ROWS or weight.shape[1] * 2 != k or scales.shape != (groups, n)
            or zeros.shape != (groups, n) or k % groups
            or (space is not None and space[0].shape[0] < rows)):
        raise ValueError(f"MSLK GEMV: x {tuple(x2.shape)}, weight {tuple(weight.shape)}, "
                         f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not fit")
    group = k // groups
    block_n, block_k, split_k, warps, stages, *more = launch or config(n, k, rows, x2.device)
    chunk = min(more[0] if more else group, group)
    by_fma = rows == 1 or (more[1:] == [1] and rows <= FMA_ROWS)
    block_k = min(block_k, chunk)
    if group % chunk or chunk % block_k or n % 16 or block_k % 16 or block_n % 16:
        raise ValueError(f"MSLK GEMV: a {n}x{k} weight in groups of {group} does not tile by "
                         f"{block_n} outputs, {block_k} inputs, chunks of {chunk} and 16x16 "
                         f"atoms")
    split_k = split_k or k // chunk
    x2 = x2.contiguous()
    y = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
    sums, counts = space or workspace(rows, n, x2.device)
    # the FMA kernel holds its rows' sums in registers (a power of two of them); tl.dot takes
    # 16 rows and more
    kernel, block_m = ((_kernel(), 1 << (rows - 1).bit_length()) if by_fma
                       else (_rows_kernel(), max(16, 1 << (rows - 1).bit_length())))
    kernel[(-(-n // block_n), split_k)](
        x2, weight.view(torch.int32), scales, zeros, y, sums, counts, rows, n, k, x2.stride(0),
        ONE_BITS, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, CHUNK=chunk, num_warps=warps, num_stages=stages)
    return y
