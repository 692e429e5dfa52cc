#!/usr/bin/env python3
"""Writes tiny_llama.gguf and tiny_llama_expected.json, the fixtures of the
SentencePiece test in crates/model-weights/tests/weights/gguf_compat.rs.

A tiny SentencePiece BPE model is trained here with Llama's settings
(identity normalization, no whitespace collapsing, a dummy prefix, byte
fallback); its pieces, scores and types go into a GGUF file written by
llama.cpp's gguf-py the way convert_hf_to_gguf.py writes them, and
SentencePiece's own encodings of a few strings (the reference llama.cpp
reimplements) go into the JSON file. (None holds a control token's text:
SentencePiece reads `<s>` in text as characters, while the rebuilt
tokenizer, like Hugging Face's and llama.cpp's with special parsing on,
matches it as the token, which chat templates rely on.)

    python3 -m venv venv && venv/bin/pip install gguf numpy sentencepiece
    venv/bin/python make_tiny_llama.py   # writes next to this script

Made with gguf 0.19.0 and sentencepiece 0.2.3.
"""

import json
import os
import tempfile

import gguf
import numpy as np
import sentencepiece as spm

HERE = os.path.dirname(os.path.abspath(__file__))

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Hello again, world of tokens.",
    "SentencePiece merges the pair whose merged piece scores highest.",
    "Llama tokenizers fall back to bytes for what they have never seen.",
    "Numbers like 12345 and 2024 are split into digits.",
    "  Leading spaces, double  spaces and\ttabs\nand new lines.",
] * 20

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces and  double  spaces",
    "new\nline and\ttab",
    "unseen: \u00e9\u00e8 \u4e2d\u6587 \U0001f600 12345",
    "",
]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as f:
            f.write("\n".join(CORPUS))
        prefix = os.path.join(tmp, "tiny")
        spm.SentencePieceTrainer.train(
            input=corpus,
            model_prefix=prefix,
            model_type="bpe",
            vocab_size=420,
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=True,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")

    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)

    w = gguf.GGUFWriter(os.path.join(HERE, "tiny_llama.gguf"), "llama")
    w.add_context_length(64)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    expected = [{"text": t, "ids": sp.encode(t), "bos": sp.bos_id()} for t in TEXTS]
    with open(os.path.join(HERE, "tiny_llama_expected.json"), "w") as f:
        json.dump(expected, f, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
