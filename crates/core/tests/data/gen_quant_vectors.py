#!/usr/bin/env python3
"""Writes the GGML quantization test vectors in quant/ (run by hand, not in CI).

Reference: gguf-py (`pip install gguf numpy`), whose quantizers reproduce
llama.cpp's `quantize_row_*_ref` bit for bit and whose dequantizers follow
ggml's `dequantize_row_*`. The Rust tests (`metrale_core::quant`) compare
their output with these files exactly.

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install gguf numpy
    /tmp/venv/bin/python crates/core/tests/data/gen_quant_vectors.py

Each `quant/<type>.bin` is, little-endian:
    u32 n            elements
    u32 has_input    1: f32 input[n] follows, and q is gguf-py's quantization of it
    f32 input[n]     (only if has_input)
    u8  q[row_bytes] quantized row (random blocks with sane scales when there is no input)
    f32 deq[n]       gguf-py's dequantization of q (Q8_K, which gguf-py lacks: q * d in f32)
"""
import os
import struct

import numpy as np
from gguf import GGMLQuantizationType as T, quants
from gguf.constants import GGML_QUANT_SIZES

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant")
rng = np.random.default_rng(20261201)


def inputs(n: int) -> np.ndarray:
    """Gaussian rows of varying scale with outliers, a zero block, a constant block."""
    x = rng.standard_normal(n).astype(np.float32)
    x *= np.repeat(rng.uniform(0.001, 3.0, n // 32).astype(np.float32), 32)
    idx = rng.choice(n, n // 64, replace=False)
    x[idx] *= rng.uniform(5, 40, idx.size).astype(np.float32)
    x[0:32] = 0.0
    x[32:64] = np.float32(0.75)
    x[64:96] = -x[64:96]
    return x


def random_blocks(qtype: T, n: int) -> np.ndarray:
    """Random bytes with every scale field set to a modest f16 (or f32) value."""
    be, bb = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n // be, bb), dtype=np.uint8)
    def f16(k):
        return rng.uniform(-0.05, 0.05, (n // be, k)).astype(np.float16).view(np.uint8)
    offsets = {T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
               T.Q6_K: [208], T.IQ4_NL: [0]}
    if qtype == T.Q8_K:
        b[:, 0:4] = rng.uniform(1e-4, 0.05, (n // be, 1)).astype(np.float32).view(np.uint8)
        qs = b[:, 4:260].view(np.int8).astype(np.int16)
        b[:, 260:292] = qs.reshape(-1, 16, 16).sum(-1).astype("<i2").view(np.uint8)
    else:
        for off in offsets[qtype]:
            b[:, off:off + 2] = f16(1)
    return b.reshape(-1)


def write(name: str, qtype: T, n: int, with_input: bool):
    if with_input:
        x = inputs(n)
        q = quants.quantize(x.reshape(1, n), qtype).reshape(-1)
    else:
        x = None
        q = random_blocks(qtype, n)
    if qtype == T.Q8_K:
        # gguf-py has no Q8_K (an activation format): ggml's qs[j] * d in f32.
        b = q.reshape(-1, 292)
        d = b[:, 0:4].copy().view("<f4")
        deq = (b[:, 4:260].view(np.int8).astype(np.float32) * d).reshape(-1)
    else:
        deq = quants.dequantize(q.reshape(1, -1), qtype).reshape(-1).astype(np.float32)
    assert deq.size == n
    with open(os.path.join(OUT, f"{name}.bin"), "wb") as f:
        f.write(struct.pack("<II", n, int(with_input)))
        if x is not None:
            f.write(x.astype("<f4").tobytes())
        f.write(q.astype(np.uint8).tobytes())
        f.write(deq.astype("<f4").tobytes())


os.makedirs(OUT, exist_ok=True)
for name, qt in [("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1),
                 ("q5_0", T.Q5_0), ("q5_1", T.Q5_1)]:
    write(name, qt, 2048, True)
for name, qt in [("q2_k", T.Q2_K), ("q3_k", T.Q3_K), ("q4_k", T.Q4_K),
                 ("q5_k", T.Q5_K), ("q6_k", T.Q6_K), ("q8_k", T.Q8_K)]:
    write(name, qt, 1024, False)
write("iq4_nl", T.IQ4_NL, 1024, False)
