#!/usr/bin/env python3
"""Time llama.cpp's batched decode (through llama-cpp-python's low-level
API) the way `metrale bench --batch B1,B2,...` times metrale's: the model
loaded once; for each batch size B a fresh context (n_seq_max = B), one
warm-up, B prompts of random token ids each prefilled in its own
llama_decode call, then greedy decode steps that each put the B sequences'
next tokens in one llama_batch and one llama_decode call. Prints a JSON
array with one object per B: prefill_tok_s, ttft_ms, decode_tok_s (all
sequences together) and decode_tok_s_per_seq.

usage: llama_batch_bench.py MODEL.gguf --threads T --prompt-len N --gen-len M
           --batch 1,4,16 [--seed S]
"""

import argparse
import ctypes
import json
import random
import resource
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--batch", default="1")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    sizes = [int(b) for b in a.batch.split(",")]

    import llama_cpp
    from llama_cpp import llama_cpp as L

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.use_mmap = False
    t0 = time.perf_counter()
    model = L.llama_model_load_from_file(a.model.encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {a.model}")
    load_s = time.perf_counter() - t0
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rng = random.Random(a.seed)
    results = []
    for b in sizes:
        prompts = [[rng.randrange(n_vocab) for _ in range(a.prompt_len)] for _ in range(b)]
        r = run_batch(L, model, n_vocab, prompts, a)
        r.update({
            "engine": "llama.cpp",
            "llama_cpp_python": llama_cpp.__version__,
            "system_info": L.llama_print_system_info().decode(errors="replace"),
            "threads": a.threads,
            "batch": b,
            "prompt_len": a.prompt_len,
            "gen_len": a.gen_len,
            "load_s": load_s,
        })
        results.append(r)
    for r in results:
        r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    L.llama_model_free(model)
    print(json.dumps(results))


def new_context(L, model, b: int, a):
    """A context for b sequences: each its own KV cells (and, in a hybrid,
    its own recurrent state), with room for a prompt or a whole decode
    step in one llama_decode call."""
    cp = L.llama_context_default_params()
    per_seq = a.prompt_len + a.gen_len + 16
    # Without a unified KV buffer, n_ctx is shared out among the sequences.
    cp.n_ctx = b * per_seq
    cp.n_batch = max(a.prompt_len, b)
    cp.n_ubatch = cp.n_batch
    cp.n_seq_max = b
    cp.n_threads = a.threads
    cp.n_threads_batch = a.threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"llama.cpp could not make a context for batch {b}")
    return ctx


def fill(batch, entries) -> None:
    """entries: (token, position, sequence, wants logits) per batch slot."""
    for i, (tok, pos, seq, logits) in enumerate(entries):
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    batch.n_tokens = len(entries)


def argmax_ith(L, ctx, i: int, n_vocab: int) -> int:
    import numpy as np

    row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
    return int(np.argmax(row))


def decode(L, ctx, batch) -> None:
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode failed: {rc}")


def prefill(L, ctx, batch, seq: int, prompt, n_vocab: int) -> int:
    last = len(prompt) - 1
    fill(batch, [(t, pos, seq, pos == last) for pos, t in enumerate(prompt)])
    decode(L, ctx, batch)
    return argmax_ith(L, ctx, last, n_vocab)


def run_batch(L, model, n_vocab: int, prompts, a) -> dict:
    b = len(prompts)
    ctx = new_context(L, model, b, a)
    batch = L.llama_batch_init(max(a.prompt_len, b), 0, 1)
    try:
        # Warm-up on a sequence id the timed runs then clear.
        prefill(L, ctx, batch, 0, prompts[0][:16], n_vocab)
        L.llama_memory_clear(L.llama_get_memory(ctx), True)

        t0 = time.perf_counter()
        nxt, ttft_s = [], 0.0
        for s, prompt in enumerate(prompts):
            nxt.append(prefill(L, ctx, batch, s, prompt, n_vocab))
            if s == 0:
                ttft_s = time.perf_counter() - t0
        prefill_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        for step in range(a.gen_len):
            pos = a.prompt_len + step
            fill(batch, [(nxt[s], pos, s, True) for s in range(b)])
            decode(L, ctx, batch)
            nxt = [argmax_ith(L, ctx, s, n_vocab) for s in range(b)]
        decode_s = time.perf_counter() - t0
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    tok_s = b * a.gen_len / decode_s if a.gen_len else 0.0
    return {
        "prefill_tok_s": b * a.prompt_len / prefill_s,
        "ttft_ms": ttft_s * 1e3,
        "decode_tok_s": tok_s,
        "decode_tok_s_per_seq": tok_s / b,
    }


if __name__ == "__main__":
    main()
