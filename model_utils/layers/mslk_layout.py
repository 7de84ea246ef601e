"""Where MSLK's pre-shuffled int4 copy keeps each weight, read off MSLK's own preshuffle.

MSLK's `preshuffle_i4` (mslk_int4.pack) reorders the weights [N, K] into the order its Hopper
tensor-core kernel loads them; it documents no format. CUTLASS builds that order (its
`compute_memory_reordering_atom`) as a small atom of rows x inputs whose nibbles are permuted
so that each thread's values lie side by side, repeated over the matrix. A kernel of our own
that reads the same copy (mslk_gemv) needs that order, so it is measured rather than assumed:
`read` runs the preshuffle on a small matrix whose nibbles spell out their own positions (four
passes of four bits) and finds the atom and the order of the atoms that reproduce every
position. A layout of another kind is refused (LayoutUnknown), and the kernel is not used.

The layout is a table: for an atom of ATOM_N rows x ATOM_K inputs, `table[r * ATOM_K + c]` is the
nibble, within its atom, of the weight at row r and input c of that atom; atoms follow each
other rows first (`rows_first`: atom (n // ATOM_N, k // ATOM_K) is number
(k // ATOM_K) * (N // ATOM_N) + n // ATOM_N) or inputs first. Nibble j of the copy is the low
half of byte j // 2 when j is even.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

# Atoms tried, (rows, inputs): the Hopper one (a warp's 16 x 16 slice of a bf16 GMMA operand)
# first, then other CUTLASS shapes.
ATOMS = ((16, 16), (16, 32), (16, 64), (32, 16), (8, 16), (8, 32), (16, 8))
# The probe's matrix: two or more atoms of every tried shape each way, groups of 128 inputs.
PROBE_N, PROBE_K, PROBE_GROUP = 64, 256, 128


class LayoutUnknown(RuntimeError):
    """The preshuffled copy is not a tiling of one permuted atom this module can read."""


@dataclasses.dataclass(frozen=True)
class Layout:
    atom_n: int
    atom_k: int
    rows_first: bool
    table: tuple[int, ...]  # nibble within the atom of (r, c), at r * atom_k + c

    def positions(self, n: int, k: int) -> torch.Tensor:
        """The nibble of the whole copy that holds each weight: int64 [n, k]."""
        if n % self.atom_n or k % self.atom_k:
            raise LayoutUnknown(f"a {n}x{k} weight is not whole {self.atom_n}x{self.atom_k} "
                                f"atoms")
        rows, cols = torch.arange(n)[:, None], torch.arange(k)[None, :]
        tile_n, tile_k = rows // self.atom_n, cols // self.atom_k
        tiles = (tile_k * (n // self.atom_n) + tile_n if self.rows_first
                 else tile_n * (k // self.atom_k) + tile_k)
        within = torch.tensor(self.table)[(rows % self.atom_n) * self.atom_k
                                          + cols % self.atom_k]
        return tiles * (self.atom_n * self.atom_k) + within


def shuffle(nibbles: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Packed nibbles int8 [N, K/2] in input order (even input low) -> the same in `layout`'s
    order: what MSLK's preshuffle gives where `layout` is the one `read` found."""
    n, k = nibbles.shape[0], nibbles.shape[1] * 2
    byte = nibbles.view(torch.uint8).to(torch.int64)
    values = torch.stack([byte & 15, byte >> 4], -1).reshape(n, k)
    out = torch.empty(n * k, dtype=torch.int64, device=nibbles.device)
    out[layout.positions(n, k).reshape(-1).to(nibbles.device)] = values.reshape(-1)
    pairs = out.reshape(-1, 2)
    return (pairs[:, 0] | pairs[:, 1] << 4).to(torch.uint8).view(torch.int8).reshape(n, k // 2)


def read(preshuffle: Callable, device: torch.device) -> Layout:
    """The layout `preshuffle(q uint8 [N, K] in 0..15, scales bf16 [K/group, N]) -> copy int8
    [N, K/2]` puts its weights in (each nibble q ^ 8, as MSLK's signed nibbles), from one small
    matrix (module doc)."""
    return fit(sources(preshuffle, device))


def sources(preshuffle: Callable, device: torch.device) -> torch.Tensor:
    """For each nibble j of the probe's preshuffled copy, the weight (row * PROBE_K + input)
    it holds: int64 [PROBE_N * PROBE_K] on the CPU."""
    n, k = PROBE_N, PROBE_K
    index = torch.arange(n * k, device=device).reshape(n, k)
    scales = torch.ones(k // PROBE_GROUP, n, dtype=torch.bfloat16, device=device)
    source = torch.zeros(n * k, dtype=torch.int64, device=device)
    for shift in range(0, (n * k - 1).bit_length(), 4):
        q = ((index >> shift) & 15).to(torch.uint8)
        copy = preshuffle(q, scales).contiguous()
        if copy.shape != (n, k // 2):
            raise LayoutUnknown(f"the preshuffled copy is {tuple(copy.shape)}, not {(n, k // 2)}")
        byte = copy.view(torch.uint8).reshape(-1).to(torch.int64)
        # nibbles are q ^ 8: undone, they give this pass's four bits back
        source |= (torch.stack([byte & 15, byte >> 4], -1).reshape(-1) ^ 8) << shift
    return source.cpu()


def fit(source: torch.Tensor) -> Layout:
    """The atom and order of atoms that put every weight where `source` (of `sources`) has it."""
    n, k = PROBE_N, PROBE_K
    if not torch.equal(source.sort().values, torch.arange(n * k)):
        raise LayoutUnknown("the preshuffle does not keep every weight's four bits once "
                            "(it re-encodes them)")
    for atom_n, atom_k in ATOMS:
        size = atom_n * atom_k
        rows, cols = source[:size] // k, source[:size] % k
        if rows.max() >= atom_n or cols.max() >= atom_k:
            continue
        table = torch.empty(size, dtype=torch.int64)
        table[rows * atom_k + cols] = torch.arange(size)
        for rows_first in (True, False):
            layout = Layout(atom_n, atom_k, rows_first, tuple(table.tolist()))
            if torch.equal(layout.positions(n, k).reshape(-1)[source], torch.arange(n * k)):
                return layout
    raise LayoutUnknown("the preshuffled copy is not one permuted atom of "
                        f"{', '.join(f'{a}x{b}' for a, b in ATOMS)} repeated over the matrix")
