"""quant_candidates.py's results as markdown: the table, each candidate against the modes
issue's targets, and each candidate's decode step by kernel."""

from __future__ import annotations


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else ""


def markdown(results: list[dict], meta: dict, streams: list[int]) -> str:
    bf16 = next((r for r in results if r["candidate"] == "bf16" and "tok_s_1" in r), None)
    head = ["candidate", "path", "weights GB", "load peak GB", "tok/s 1 stream", "x bf16",
            "TTFT ms", "TTFT ms, long prompt", "x bf16 (long)"]
    for n in streams:
        head += [f"tok/s {n} streams", f"x bf16 ({n})"]
    head += ["KL vs fp32", "top-1 vs fp32", "step ms", "load+compile s"]
    lines = [f"Host: {meta}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "tok_s_1" not in r:
            lines.append(f"| {r['candidate']} | {r.get('skipped') or r.get('error')} |" +
                         " |" * (len(head) - 2))
            continue
        cells = [r["candidate"], r["decode_path"], r.get("weights_gb", r["footprint_gb"]),
                 r.get("load_peak_gb"), r["tok_s_1"],
                 ratio(r["tok_s_1"], bf16 and bf16["tok_s_1"]), r["ttft_ms_1"],
                 r.get("ttft_ms_long"), ratio(r.get("ttft_ms_long"),
                                              bf16 and bf16.get("ttft_ms_long"))]
        for n in streams:
            agg = r.get(f"aggregate_tok_s_{n}")
            cells += [agg, ratio(agg, bf16 and bf16.get(f"aggregate_tok_s_{n}"))]
        cells += [r.get("kl_vs_fp32"), r.get("top1_vs_fp32"),
                 r["profile"] and r["profile"]["step_wall_ms"], r["load_and_compile_s"]]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    goal = ("Targets (one H200, 7B shape, against bf16): " + "; ".join(
        f"{bits}: one stream >= {t['one']}x, "
        + "".join(f"{n} streams >= {need}x, " for n, need in t["streams"].items())
        + f"TTFT <= {t['ttft']}x" + (f", the long prompt's <= {t['long']}x" if "long" in t else "")
        for bits, t in TARGETS.items()) + ".")
    lines += ["", goal, ""]
    for r in results:
        if "tok_s_1" in r and bf16 and r is not bf16:
            lines.append(f"- {r['candidate']}: " + "; ".join(targets(r, bf16, streams)))
    for r in results:
        if r.get("profile"):
            p = r["profile"]
            title = (f"### {r['candidate']}: one decode step, {p['step_wall_ms']} ms wall, "
                     f"{p['kernel_us_per_step']} us in kernels; {p['profiled']}")
            lines += ["", title, "", "| kernel | calls | us per step |", "|---|---|---|"]
            lines += [f"| `{k['kernel'][:100]}` | {k['calls_per_step']:g} | {k['us_per_step']} |"
                      for k in p["kernels"][:15]]
    return "\n".join(lines) + "\n"


# The modes issue's targets, x bf16 in the same run.
TARGETS = {"4-bit": {"one": 1.8, "streams": {8: 1.3, 32: 1.1}, "ttft": 1.5, "long": 1.3},
           "8-bit": {"one": 1.4, "streams": {32: 1.15}, "ttft": 1.2}}


def targets(r: dict, bf16: dict, streams: list[int]) -> list[str]:
    """Each target of the quantized modes, met or missed, with the figures (higher speed,
    lower times)."""
    name = r["candidate"]
    bits = "4-bit" if any(k in name for k in ("int4", "nf4", "fp4")) else \
        "8-bit" if any(k in name for k in ("int8", "fp8")) else None
    if bits is None:
        return ["no target"]
    goal = TARGETS[bits]
    figures = {"one stream": (r["tok_s_1"] / bf16["tok_s_1"], goal["one"], True),
               "TTFT": (r["ttft_ms_1"] / bf16["ttft_ms_1"], goal["ttft"], False)}
    for n, need in goal["streams"].items():
        key = f"aggregate_tok_s_{n}"
        if n in streams and r.get(key) and bf16.get(key):
            figures[f"{n} streams"] = (r[key] / bf16[key], need, True)
    if "long" in goal and r.get("ttft_ms_long") and bf16.get("ttft_ms_long"):
        figures["long prompt's TTFT"] = (r["ttft_ms_long"] / bf16["ttft_ms_long"],
                                         goal["long"], False)
    return [f"{what} {x:.2f}x bf16 ({'met' if (x >= need if higher else x <= need) else 'missed'}"
            f", target {need}x)" for what, (x, need, higher) in figures.items()]
