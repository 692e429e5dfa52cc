#!/usr/bin/env python3
"""Print the side-by-side table of a compare run (work/results.jsonl, or
compare_quant.sh's work/quant-results.jsonl, whose rows also name the weight
format) and the same table as Markdown (for docs/PERFORMANCE.md).

With several rounds per shape every figure is the median over the rounds, and
every ratio the median of the rounds' ratios (each round runs both engines one
after the other, so its ratio is the fairer comparison on a noisy machine),
with their range in brackets."""

import json
import statistics
import sys
from collections import OrderedDict


def ratio(a, b):
    return a / b if b else float("nan")


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def ratio_cell(pairs):
    rs = [ratio(a, b) for a, b in pairs]
    if not rs:
        return "-"
    if len(rs) == 1:
        return f"{rs[0]:.2f}x"
    return f"{med(rs):.2f}x ({min(rs):.2f}-{max(rs):.2f})"


def summarise(shape, runs):
    m = [r["metrale"] for r in runs]
    l = [r["llama"] for r in runs]
    mb = [r.get("metrale_bf16_dot") for r in runs]
    pre = [(a["prefill_tok_s"], b["prefill_tok_s"]) for a, b in zip(m, l)]
    pre_dot = [(a["prefill_tok_s"], b["prefill_tok_s"]) for a, b in zip(mb, l) if a]
    dec = [(a["decode_tok_s"], b["decode_tok_s"]) for a, b in zip(m, l)]
    roof = [a["roofline_decode_tok_s"] for a in m if a.get("roofline_decode_tok_s")]
    frac = [a["decode_tok_s"] / a["roofline_decode_tok_s"] for a in m if a.get("roofline_decode_tok_s")]
    lfrac = [b["decode_tok_s"] / a["roofline_decode_tok_s"] for a, b in zip(m, l) if a.get("roofline_decode_tok_s")]
    # The memory floor (weights + recurrent state + KV cache, as metrale's
    # bench counts them), for both engines against the same bytes.
    floor = [(a, b) for a, b in zip(m, l) if a.get("floor_decode_tok_s")]
    ffrac = [a["decode_tok_s"] / a["floor_decode_tok_s"] for a, _ in floor]
    lffrac = [b["decode_tok_s"] / a["floor_decode_tok_s"] for a, b in floor]
    return (
        shape,
        str(len(runs)),
        f"{med([a for a, _ in pre]):.1f}", f"{med([b for _, b in pre]):.1f}", ratio_cell(pre),
        f"{med([a for a, _ in pre_dot]):.1f}" if pre_dot else "-", ratio_cell(pre_dot),
        f"{med([a for a, _ in dec]):.2f}", f"{med([b for _, b in dec]):.2f}", ratio_cell(dec),
        f"{med(roof):.2f}" if roof else "-",
        f"{100 * med(frac):.0f}%" if frac else "-",
        f"{100 * med(lfrac):.0f}%" if lfrac else "-",
        f"{100 * med(ffrac):.0f}% / {100 * med(lffrac):.0f}%" if ffrac else "-",
    )


def print_table(head, table):
    """The rows aligned as text, then as a Markdown table."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    for line in [head] + table:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for line in table:
        print("| " + " | ".join(line) + " |")


def cpu_model() -> str:
    """This machine's CPU, as /proc/cpuinfo names it, and whether it has AMX."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown CPU"
    name = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")), "unknown CPU")
    return f"{name}, {'AMX' if 'amx_tile' in info else 'no AMX'}"


def print_machine(metrale_runs, llama_runs) -> None:
    """The machine, metrale's bf16 kernels and llama.cpp's build (each
    distinct system_info line), as every result must record them."""
    kernels = sorted({str(m.get("bf16_kernel")) for m in metrale_runs})
    infos = sorted({l.get("system_info", "(not recorded)").strip() for l in llama_runs})
    print(f"machine: {cpu_model()}; metrale bf16 kernel: {', '.join(kernels)}")
    for info in infos:
        print(f"llama.cpp system_info: {info}")


def main() -> None:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    by_shape = OrderedDict()
    for r in rows:
        key = f'{r["shape"]} {r["format"]}' if r.get("format") else r["shape"]
        by_shape.setdefault(key, []).append(r)
    head = ("shape", "rounds", "metrale prefill", "llama.cpp prefill", "ratio", "metrale prefill bf16-dot", "ratio",
            "metrale decode", "llama.cpp decode", "ratio", "roofline", "metrale/roofline", "llama.cpp/roofline",
            "memory floor (metrale's bytes): metrale / llama.cpp")
    table = [summarise(shape, runs) for shape, runs in by_shape.items()]
    print_table(head, table)
    if rows:
        bw = [r["metrale"].get("bandwidth_bytes_s", 0) / 1e9 for r in rows]
        m = rows[0]["metrale"]
        print(f"\nbandwidth probe: {min(bw):.1f}-{max(bw):.1f} GB/s (median {med(bw):.1f}) with {m['threads']} threads; "
              f"weights {'as named' if m.get('format') or rows[0].get('format') else m['weight_dtype']}; "
              f"prompt {m['prompt_len']}, generated {m['gen_len']}")
        ttft = [(f'{r["shape"]} {r["format"]}' if r.get("format") else r["shape"], r["metrale"]["ttft_ms"], r["llama"]["ttft_ms"],
                 r["metrale"]["peak_rss_bytes"] / 2**20, r["llama"]["peak_rss_bytes"] / 2**20) for r in rows]
        print("time to first token ms (metrale f32 / llama.cpp), peak RSS MiB (metrale / llama.cpp), medians:")
        for shape in by_shape:
            t = [x for x in ttft if x[0] == shape]
            print(f"  {shape}: {med([x[1] for x in t]):.0f} / {med([x[2] for x in t]):.0f} ms, "
                  f"{med([x[3] for x in t]):.0f} / {med([x[4] for x in t]):.0f} MiB")
        print_machine([r["metrale"] for r in rows], [r["llama"] for r in rows])


if __name__ == "__main__":
    main()
