#!/usr/bin/env python3
"""Time llama.cpp (through llama-cpp-python) the way `metrale bench` times
metrale: one warm-up, then a prompt of random token ids in one prefill
(batches of up to 512), then greedy decoding one token at a time. Prints one
JSON object with prefill_tok_s, decode_tok_s, ttft_ms and peak_rss_bytes.

usage: llama_bench.py MODEL.gguf --threads T --prompt-len N --gen-len M [--seed S]
"""

import argparse
import json
import random
import resource
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import numpy as np
    from llama_cpp import Llama, llama_cpp

    t0 = time.perf_counter()
    llm = Llama(
        model_path=a.model,
        n_ctx=a.prompt_len + a.gen_len + 32,
        n_batch=512,
        n_ubatch=512,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        use_mmap=False,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    vocab = llm.n_vocab()
    rng = random.Random(a.seed)
    prompt = [rng.randrange(vocab) for _ in range(a.prompt_len)]

    def last_argmax() -> int:
        # eval() asks for the last token's logits only; read them directly.
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

    # Warm-up: thread pool, first-call costs.
    llm.eval(prompt[:16])
    llm.eval([prompt[16 % len(prompt)]])
    llm.reset()

    t0 = time.perf_counter()
    llm.eval(prompt)
    nxt = last_argmax()
    prefill_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    for _ in range(a.gen_len):
        llm.eval([nxt])
        nxt = last_argmax()
    decode_s = time.perf_counter() - t0

    print(json.dumps({
        "engine": "llama.cpp",
        "llama_cpp_python": __import__("llama_cpp").__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "threads": a.threads,
        "prompt_len": a.prompt_len,
        "gen_len": a.gen_len,
        "load_s": load_s,
        "prefill_tok_s": a.prompt_len / prefill_s,
        "ttft_ms": prefill_s * 1e3,
        "decode_tok_s": a.gen_len / decode_s if a.gen_len else 0.0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


if __name__ == "__main__":
    main()
