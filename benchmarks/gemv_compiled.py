"""mslk_gemv's kernel compiled for a Hopper GPU on any machine, no GPU needed (Triton's compiler
and the ptxas its wheel carries): per launch, the registers a thread takes, bytes spilled, the
layout conversions left inside the innermost loop (each moves a whole tensor between threads)
and that loop's instructions per weight (for all its rows: the one-row kernel's FMAs, the
tensor-core kernel's MMAs from two rows) with their mix. Counts, not timings: what to look at
before a GPU run, not instead of one (BENCHMARKS.md, "MSLK's layout read off its
preshuffle, and a GEMV over it").

    python benchmarks/gemv_compiled.py                      # the launches below
    python benchmarks/gemv_compiled.py --launch 1,512,32,0,4,64  # rows, BLOCK_N, BLOCK_K,
                                                               # SPLIT_K, warps[, CHUNK]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model_utils.layers import int8_rows, mslk_gemv, mslk_rows  # noqa: E402

LAUNCHES = [(1, 512, 32, 0, 4, 64), (1, 128, 64, 4, 4), (1, 64, 64, 1, 4), (2, 64, 64, 4, 4),
            (8, 32, 32, 4, 4)]


def compile_for_hopper(rows: int, block_n: int, block_k: int, split_k: int, warps: int,
                       chunk: int = 128, fma: int = 0, swapped: bool | str = False,
                       stages: int = 2, int8_kernel=None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"x_ptr": "*bf16", "w_ptr": "*u8" if swapped else "*i32", "s_ptr": "*bf16",
                 "z_ptr": "*bf16", "y_ptr": "*bf16", "space_ptr": "*fp32", "count_ptr": "*i32",
                 "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "one_bits": "i32"}
    # as mslk_gemv.gemv launches: one row on the FMA kernel, more on the tensor-core one;
    # `swapped`: mslk_rows' kernel (the weights tl.dot's first operand)
    pow2 = 1 << (rows - 1).bit_length()
    kernel, block_m = ((mslk_gemv._kernel(), pow2) if (rows == 1 or fma) and not swapped
                       else (mslk_gemv._rows_kernel(), max(16, pow2)))
    constants = {"GROUP": 128, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                 "SPLIT_K": split_k or 3584 // chunk, "CHUNK": chunk}  # 0: the 7B's 3584 inputs
    if swapped == "int8":  # int8_rows' kernel: no zero points, no groups
        kernel = int8_kernel or int8_rows._kernel()  # another of its signature: a sketch's
        signature = {name: kind for name, kind in signature.items()
                     if name not in ("z_ptr", "one_bits")} | {"w_ptr": "*i8"}
        constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                     "SPLIT_K": split_k or 1, "OFFSET_SUM": float(int8_rows.OFFSET), "ASM": True}
    elif swapped:
        kernel = mslk_rows._kernel()
        constants["BLOCK_M"] = max(mslk_rows.least_block_m(warps), pow2)
        del signature["one_bits"]
        magic, offset = mslk_rows.MAGIC[torch.bfloat16]
        constants.update(MAGIC_BITS=magic, OFFSET=offset, ASM=True)
    source = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(
        constants, "constexpr")}, constexprs=constants,
        # pointers, N, K and the row stride: multiples of 16, as Triton specializes them at a
        # launch (the 7B's shapes)
        attrs={(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
               if name.endswith("_ptr") or name in ("N", "K", "stride_xm")})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def innermost_loop(lines: list[str], opens: str, closes) -> list[str]:
    """The lines of the last loop that opens with `opens` and ends where `closes(line)`."""
    start = max(i for i, line in enumerate(lines) if opens in line)
    body = []
    for line in lines[start + 1:]:
        if closes(lines[start], line):
            break
        body.append(line)
    return body


def report(rows: int, block_n: int, block_k: int, split_k: int, warps: int,
           chunk: int = 128, fma: int = 0, swapped: bool | str = False,
           stages: int = 2, int8_kernel=None) -> dict:
    kernel = compile_for_hopper(rows, block_n, block_k, split_k, warps, chunk, fma, swapped,
                                stages, int8_kernel)
    ttgir = kernel.asm["ttgir"].splitlines()

    def deeper_ends(head: str, line: str) -> bool:
        indent = len(head) - len(head.lstrip())
        return bool(line.strip()) and len(line) - len(line.lstrip()) <= indent

    loop = innermost_loop(ttgir, "scf.for", deeper_ends)
    conversions = sum("ttg.convert_layout" in line for line in loop)
    # a conversion into a tensor-core operand moves the weights themselves between threads
    to_operand = sum("ttg.convert_layout" in line and "-> tensor" in line
                     and "#ttg.dot_op" in line.split("-> tensor")[1] for line in loop)
    bin_dir = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([bin_dir / "cuobjdump", "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([bin_dir / "nvdisasm", "-c", cubin.name],
                              capture_output=True, text=True).stdout.splitlines()
    # the innermost SASS loop that multiplies, a chunk an iteration: the shortest span from a
    # label back to a branch to it with FFMAs or HMMAs inside (an atomic's retry loop or the
    # closing trap have none); the whole kernel where a program's share is one chunk
    labels = {m.group(1): i for i, line in enumerate(sass)
              if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(sass)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line))
             and labels.get(m.group(1), i) < i]
    loops = [span for span in loops
             if any(op in line for op in ("FFMA", "HMMA", "HGMMA")
                    for line in sass[span[0]:span[1]])]
    first, last = min(loops, key=lambda span: span[1] - span[0]) if loops else (0, len(sass))
    opcodes = collections.Counter(
        m.group(1).split(".")[0] for line in sass[first:last]
        if (m := re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\d\s+)?([A-Z0-9_.]+)", line)))
    weights = block_n * chunk / (32 * warps)  # per thread and chunk
    return {"launch": [rows, block_n, block_k, split_k, warps, chunk, fma],
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "spilled_bytes": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
            "inner_loop_conversions": conversions,
            "operand_conversions": to_operand,
            "tensor_cores": "HGMMA" if any("HGMMA" in line for line in sass) else (
                "HMMA" if any("HMMA" in line for line in sass) else "none"),
            "loop_instructions": sum(opcodes.values()),
            "per_weight": round(sum(opcodes.values()) / weights, 2),
            # values moved between a warp's threads in the loop (a reduction's shuffles)
            "shuffles": opcodes["SHFL"],
            "mix": dict(opcodes.most_common(6))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", action="append",
                        help="rows,BLOCK_N,BLOCK_K,SPLIT_K,warps[,CHUNK[,FMA]] (repeatable)")
    parser.add_argument("--swapped", action="store_true",
                        help="mslk_rows' kernel (its launches rows,BLOCK_N,BLOCK_K,SPLIT_K,"
                             "warps)")
    parser.add_argument("--int8", action="store_true",
                        help="int8_rows' kernel over int8-wo's fragment-ordered copy (the "
                             "same launches)")
    args = parser.parse_args()
    launches = ([tuple(int(v) for v in text.split(",")) for text in args.launch]
                if args.launch else LAUNCHES)
    for launch in launches:
        if args.int8:  # a loop iteration is one step of BLOCK_K inputs: the weights counted
            print(report(*launch[:5], chunk=launch[2], swapped="int8", stages=3), flush=True)
        else:
            print(report(*launch, swapped=True, stages=3) if args.swapped else report(*launch),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
