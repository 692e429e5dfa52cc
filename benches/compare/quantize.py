#!/usr/bin/env python3
"""Quantize a GGUF file with llama.cpp's own quantizer (`llama_model_quantize`
through llama-cpp-python), as `llama-quantize IN OUT TYPE` would.

usage: quantize.py IN.gguf OUT.gguf {Q8_0,Q4_K_M,Q4_0,Q5_K_M,Q6_K,...} [--threads T]
"""

import argparse
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("inp")
    p.add_argument("out")
    p.add_argument("type")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()

    from llama_cpp import llama_cpp as ll

    ftype = getattr(ll, f"LLAMA_FTYPE_MOSTLY_{a.type.upper()}", None)
    if ftype is None:
        sys.exit(f"unknown quantization type {a.type}")
    params = ll.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = a.threads
    rc = ll.llama_model_quantize(a.inp.encode(), a.out.encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc})")


if __name__ == "__main__":
    main()
