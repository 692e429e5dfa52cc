#!/usr/bin/env python3
"""Train metrale's bundled default model (models/default/) from scratch.

A small Granite-4.0-H-style hybrid (Mamba-2 and attention layers, dense
shared MLP, no experts) with its own byte-level BPE tokenizer, trained on
the quotations of Debian's `fortunes` and `fortunes-min` packages, on CPU.
See docs/DEFAULT-MODEL.md for what it needs and how to rerun it.

    python3 scripts/train_default_model.py --fortunes-dir DIR --out models/default \
        --steps N [--bench]

DIR is the package's /usr/share/games/fortunes (for example from
`apt-get download fortunes fortunes-min && dpkg -x ...`).
"""

import argparse
import json
import math
import os
import random
import re
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

# Files of the packages left out of the corpus: pictures, not prose, and a
# file of non-English text.
SKIP = {"ascii-art", "translate-me"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def read_corpus(d):
    """The fortunes of every text file in `d` (files without an extension)."""
    docs = []
    names = sorted(n for n in os.listdir(d) if "." not in n and n not in SKIP)
    for name in names:
        raw = open(os.path.join(d, name), "rb").read().decode("utf-8", "replace")
        for chunk in re.split(r"\n%\n", raw.replace("\r\n", "\n")):
            text = chunk.replace("\t", "    ").strip("\n")
            text = "\n".join(line.rstrip() for line in text.split("\n")).strip()
            if len(text) >= 10:
                docs.append(text)
    return names, docs


def train_tokenizer(docs, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def make_config(vocab_size, hidden, layers):
    return GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        shared_intermediate_size=hidden * 2,
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=len(layers),
        layer_types=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        position_embedding_type="rope",
        rope_theta=10000.0,
        mamba_n_heads=hidden * 2 // 32,
        mamba_d_head=32,
        mamba_d_state=32,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        attention_multiplier=1.0 / math.sqrt(hidden // 4),
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=0,
        hidden_act="silu",
        attention_bias=False,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fortunes-dir", default="/usr/share/games/fortunes")
    ap.add_argument("--out", default="models/default")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", default="mamba,attention,mamba,attention")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1400)
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="also stop (and decay the learning rate) by wall time; 0: steps only")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bench", action="store_true", help="time 8 steps and stop")
    ap.add_argument("--corpus-out", help="also write the cleaned corpus here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()

    names, docs = read_corpus(args.fortunes_dir)
    print(f"corpus: {len(docs)} fortunes, {sum(map(len, docs))} chars from {len(names)} files")
    if args.corpus_out:
        with open(args.corpus_out, "w") as f:
            f.write("\n%\n".join(docs) + "\n")
    rng = random.Random(args.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_val = len(docs) // 50
    val_docs = [docs[i] for i in order[:n_val]]
    train_docs = [docs[i] for i in order[n_val:]]

    tok = train_tokenizer(train_docs, args.vocab)
    vocab = tok.get_vocab_size()

    def stream(ds):
        ids = []
        for d in ds:
            ids.extend(tok.encode(d).ids)
            ids.append(0)  # <|endoftext|> ends each fortune
        return torch.tensor(ids, dtype=torch.long)

    train_ids, val_ids = stream(train_docs), stream(val_docs)
    print(f"tokens: train {len(train_ids)}, val {len(val_ids)}, vocab {vocab}")

    layers = args.layers.split(",")
    cfg = make_config(vocab, args.hidden, layers)
    model = GraniteMoeHybridForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    steps = 8 if args.bench else args.steps
    warm = min(100, steps // 10)

    def progress(s):
        p = (s - warm) / max(1, steps - warm)
        if args.minutes > 0:
            p = max(p, (time.time() - t_train) / (60 * args.minutes))
        return min(1.0, p)

    def lr_at(s):
        if s < warm:
            return args.lr * (s + 1) / warm
        p = progress(s)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    def batch(ids, g):
        ix = torch.randint(0, len(ids) - args.seq - 1, (args.batch,), generator=g)
        x = torch.stack([ids[i : i + args.seq] for i in ix])
        y = torch.stack([ids[i + 1 : i + args.seq + 1] for i in ix])
        return x, y

    @torch.no_grad()
    def val_loss():
        model.eval()
        tot, n = 0.0, 0
        for i in range(0, len(val_ids) - args.seq - 1, args.seq):
            x = val_ids[i : i + args.seq][None]
            y = val_ids[i + 1 : i + args.seq + 1][None]
            out = model(input_ids=x)
            tot += torch.nn.functional.cross_entropy(out.logits[0].float(), y[0], reduction="sum").item()
            n += y.numel()
        model.train()
        return tot / n

    g = torch.Generator().manual_seed(args.seed)
    model.train()
    ema = None
    t_train = time.time()
    log = []
    done = 0
    for s in range(steps):
        if s >= warm and progress(s) >= 1.0:
            break
        done = s + 1
        for group in opt.param_groups:
            group["lr"] = lr_at(s)
        x, y = batch(train_ids, g)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if args.bench:
            dt = (time.time() - t_train) / (s + 1)
            print(f"bench step {s} loss {loss.item():.3f} {dt:.2f} s/step "
                  f"{args.batch * args.seq / dt:.0f} tok/s", flush=True)
            continue
        if s % 50 == 0 or s == steps - 1:
            el = time.time() - t_train
            print(f"step {s} loss {loss.item():.3f} ema {ema:.3f} lr {lr_at(s):.2e} {el:.0f}s", flush=True)
        if (s + 1) % 200 == 0:
            vl = val_loss()
            log.append((s + 1, ema, vl))
            print(f"step {s + 1} train(ema) {ema:.3f} val {vl:.3f}", flush=True)
    if args.bench:
        return

    steps = done
    vl = val_loss()
    log.append((steps, ema, vl))
    print(f"final: steps {steps} train(ema) {ema:.3f} val {vl:.3f}", flush=True)
    train_time = time.time() - t_train
    os.makedirs(args.out, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 512,
                # Not a chat model: each message is written as a quotation
                # ending with <|endoftext|> (the separator in training), so
                # the reply is a quotation of the model's own.
                "chat_template": "{% for message in messages %}{{ message['content'] }}<|endoftext|>{% endfor %}",
                "add_bos_token": False,
            },
            f,
            indent=2,
        )
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump(
            {
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 40,
                "repetition_penalty": 1.1,
                "max_new_tokens": 48,
                "eos_token_id": 0,
                "pad_token_id": 0,
            },
            f,
            indent=2,
        )
    summary = {
        "corpus_files": names,
        "fortunes": len(docs),
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "vocab": vocab,
        "params": n_params,
        "layers": layers,
        "hidden": args.hidden,
        "seq": args.seq,
        "batch": args.batch,
        "steps": steps,
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "train_seconds": round(train_time),
        "total_seconds": round(time.time() - t0),
        "log": log,
        "torch": torch.__version__,
    }
    print(json.dumps(summary))
    with open(os.path.join(args.out, "training_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
