#!/usr/bin/env python3
"""Print the table of a compare_batch.sh run (work/batch-results.jsonl), and
the same table as Markdown (for docs/PERFORMANCE.md): per shape and batch
size, both engines' decode tok/s (all sequences together) and their ratio,
and what metrale's decode steps achieved against the machine's peaks.

Figures are medians over the rounds; a ratio is the median of the rounds'
ratios (each round runs both engines back to back), its range in brackets.
llama.cpp's GFLOP/s count the same FLOPs per token as metrale's report
(2 x the parameters a decode step reads per token)."""

import json
import math
import sys
from collections import OrderedDict

from report import med, print_machine, print_table, ratio_cell


def by_batch(runs):
    """{batch: [(metrale object, llama.cpp object) per round]}."""
    out = OrderedDict()
    for r in runs:
        ls = {x["batch"]: x for x in r["llama"]}
        for m in r["metrale"]:
            if m["batch"] in ls:
                out.setdefault(m["batch"], []).append((m, ls[m["batch"]]))
    return out


def pct(xs):
    xs = [x for x in xs if x is not None]
    return f"{100 * med(xs):.1f}%" if xs else "-"


def row(shape, b, pairs):
    m = [a for a, _ in pairs]
    l = [c for _, c in pairs]
    dec = [(a["decode_tok_s"], c["decode_tok_s"]) for a, c in pairs]
    flops_per_tok = med([a["decode_flops_per_token"] for a in m])
    peak = med([a["compute_peak_flop_s"] for a in m if a.get("compute_peak_flop_s")])
    return (
        shape, str(b), str(len(pairs)),
        f"{med([a for a, _ in dec]):.1f}", f"{med([c for _, c in dec]):.1f}", ratio_cell(dec),
        f"{med([a['decode_tok_s_per_seq'] for a in m]):.2f}",
        f"{med([c['decode_tok_s_per_seq'] for c in l]):.2f}",
        f"{med([a['decode_flop_s'] for a in m]) / 1e9:.1f}",
        pct([a.get("compute_fraction") for a in m]),
        f"{flops_per_tok * med([c['decode_tok_s'] for c in l]) / 1e9:.1f}",
        pct([flops_per_tok * c["decode_tok_s"] / peak for c in l] if not math.isnan(peak) else []),
        f"{med([a['decode_weight_bytes_s'] for a in m]) / 1e9:.1f}",
        pct([a.get("bandwidth_fraction") for a in m]),
    )


def main() -> None:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    by_shape = OrderedDict()
    for r in rows:
        key = f'{r["shape"]} {r["format"]}' if r.get("format") else r["shape"]
        by_shape.setdefault(key, []).append(r)
    head = ("shape", "batch", "rounds", "metrale decode tok/s", "llama.cpp decode tok/s", "ratio",
            "metrale tok/s/seq", "llama.cpp tok/s/seq", "metrale GFLOP/s", "of peak",
            "llama.cpp GFLOP/s", "of peak", "metrale weights GB/s", "of bandwidth")
    table = [row(shape, b, pairs) for shape, runs in by_shape.items() for b, pairs in by_batch(runs).items()]
    print_table(head, table)
    ms = [m for r in rows for m in r["metrale"]]
    if ms:
        bw = [m["bandwidth_bytes_s"] / 1e9 for m in ms if m.get("bandwidth_bytes_s")]
        fma = [m["peak_f32_fma_flop_s"] / 1e9 for m in ms if m.get("peak_f32_fma_flop_s")]
        dot = [m["peak_bf16_dot_flop_s"] / 1e9 for m in ms if m.get("peak_bf16_dot_flop_s")]
        amx = [m["peak_amx_bf16_flop_s"] / 1e9 for m in ms if m.get("peak_amx_bf16_flop_s")]
        amx_s = f", bf16 AMX {med(amx):.0f} GFLOP/s" if amx else ""
        kind = ms[0].get("compute_peak_kind") or "-"
        print(f"\nprobes (medians over runs, {ms[0]['threads']} threads): bandwidth {med(bw):.1f} GB/s, "
              f"f32 FMA {med(fma):.0f} GFLOP/s, bf16 dot {med(dot):.0f} GFLOP/s{amx_s}; 'of peak' is against the {kind} peak; "
              f"prompt {ms[0]['prompt_len']}, generated {ms[0]['gen_len']} per sequence")
    print_machine([m for r in rows for m in r["metrale"]], [x for r in rows for x in r["llama"]])


if __name__ == "__main__":
    main()
