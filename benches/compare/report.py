#!/usr/bin/env python3
"""Print the side-by-side table of a compare run (work/results.jsonl) and the
same table as Markdown (for docs/PERFORMANCE.md)."""

import json
import sys


def main() -> None:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    head = ("shape", "metrale prefill", "llama.cpp prefill", "ratio", "metrale prefill bf16-dot", "ratio",
            "metrale decode", "llama.cpp decode", "ratio", "roofline", "decode/roofline")
    table = []
    for r in rows:
        m, l, mb = r["metrale"], r["llama"], r.get("metrale_bf16_dot")
        ratio = lambda a, b: a / b if b else float("nan")
        table.append((
            r["shape"],
            f"{m['prefill_tok_s']:.1f}", f"{l['prefill_tok_s']:.1f}", f"{ratio(m['prefill_tok_s'], l['prefill_tok_s']):.2f}x",
            f"{mb['prefill_tok_s']:.1f}" if mb else "-", f"{ratio(mb['prefill_tok_s'], l['prefill_tok_s']):.2f}x" if mb else "-",
            f"{m['decode_tok_s']:.2f}", f"{l['decode_tok_s']:.2f}", f"{ratio(m['decode_tok_s'], l['decode_tok_s']):.2f}x",
            f"{m['roofline_decode_tok_s']:.2f}" if m.get("roofline_decode_tok_s") else "-",
            f"{100 * m['roofline_fraction']:.0f}%" if m.get("roofline_fraction") else "-",
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    for line in [head] + table:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for line in table:
        print("| " + " | ".join(line) + " |")
    if rows:
        m = rows[0]["metrale"]
        print(f"\nbandwidth probe: {m.get('bandwidth_bytes_s', 0) / 1e9:.1f} GB/s with {m['threads']} threads; "
              f"weights {m['weight_dtype']}; prompt {m['prompt_len']}, generated {m['gen_len']}")


if __name__ == "__main__":
    main()
