#!/usr/bin/env python3
"""Golden logits for the bundled default model (models/default), made the way
the fixtures' are (tests/fixtures/gen_fixtures.py): transformers, float32 on the
CPU from the stored bf16 weights, eager attention, no optimized kernels.

Writes tests/fixtures/default_model/golden.safetensors: for each prompt i,
prompt_i (I64 [P]), tokens_i (I64 [P+12], the prompt and 12 tokens of greedy
decoding by `generate` with its cache) and logits_i (F32 [P+12, V], one uncached
forward over tokens_i); metadata as in the fixtures.

Usage: python3 scripts/gen_default_golden.py [MODEL_DIR] [OUT]
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer

PROMPTS = [
    "The meaning of life is",
    "A friend is someone who knows all about you and still likes you. Never trust a computer you can't throw out a window.",
    "I",
    "The best way to predict the future is to invent it. The trouble with the rat race is that even if you win, "
    "you're still a rat. Always remember that you are absolutely unique, just like everyone else.",
]
NEW_TOKENS = 12


def main():
    model_dir = sys.argv[1] if len(sys.argv) > 1 else "models/default"
    out = sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/default_model/golden.safetensors"
    torch.manual_seed(0)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    tensors, margins = {}, []
    for i, text in enumerate(PROMPTS):
        ids = torch.tensor([tok.encode(text).ids], dtype=torch.long)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 use_cache=True, pad_token_id=0, eos_token_id=None, repetition_penalty=1.0,
                                 temperature=None, top_p=None, top_k=None)
            full = model(gen, use_cache=False).logits[0].float()
        P = ids.shape[1]
        greedy = full[P - 1:-1].argmax(-1)
        if not torch.equal(greedy, gen[0, P:]):
            raise SystemExit(f"prompt {i}: cached generate disagrees with the uncached forward")
        top2 = full[P - 1:-1].topk(2, dim=-1).values
        margins.append(float((top2[:, 0] - top2[:, 1]).min()))
        tensors[f"prompt_{i}"] = ids[0].clone()
        tensors[f"tokens_{i}"] = gen[0].clone()
        tensors[f"logits_{i}"] = full.contiguous()
        print(i, repr(tok.decode(gen[0].tolist())))
    meta = {
        "arch": "default_model",
        "model_type": model.config.model_type,
        "weight_dtype": "bfloat16",
        "prompts": str(len(PROMPTS)),
        "new_tokens": str(NEW_TOKENS),
        "min_top1_margin": f"{min(margins):.6f}",
        "logit_std": f"{float(tensors['logits_1'].std()):.6f}",
        "logit_max_abs": f"{max(float(t.abs().max()) for k, t in tensors.items() if k.startswith('logits')):.6f}",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    save_file(tensors, out, metadata=meta)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
