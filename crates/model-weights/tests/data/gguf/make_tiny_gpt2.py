#!/usr/bin/env python3
"""Writes tiny_gpt2.gguf and tiny_gpt2_tokenizer.json, the fixtures of
crates/model-weights/tests/weights/gguf_compat.rs: a GGUF file written by llama.cpp's
own gguf-py (not by metrale's writer), with metadata of every value type, a
few tensors (f32, f16, q8_0, i32) and a small byte-level BPE vocabulary
trained here, whose tokenizer.json is the reference the tokenizer rebuilt
from the GGUF metadata must match.

    python3 -m venv venv && venv/bin/pip install gguf numpy tokenizers
    venv/bin/python make_tiny_gpt2.py   # writes next to this script

The output is deterministic for given gguf and tokenizers versions (made
with gguf 0.19.0 and tokenizers 0.23.3).
"""

import os

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Hello again, world of tokens.",
    "GGUF files carry their tokenizer in the metadata.",
    "Byte-level BPE merges the most frequent pairs first.",
    "Numbers like 12345 and 2024 are split, don't you think?",
    "llama.cpp reads tensors of many types: f32, f16, q8_0.",
] * 4


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<custom>"])
    return tok


def main() -> None:
    tok = train_tokenizer()
    tok.save(os.path.join(HERE, "tiny_gpt2_tokenizer.json"))
    model = tok.to_str()
    import json

    spec = json.loads(model)
    vocab = spec["model"]["vocab"]
    added = {t["id"]: t for t in spec["added_tokens"]}
    n = max(max(vocab.values()), max(added)) + 1
    tokens = [""] * n
    types = [gguf.TokenType.NORMAL] * n
    for t, i in vocab.items():
        tokens[i] = t
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = gguf.TokenType.CONTROL if t["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]

    w = gguf.GGUFWriter(os.path.join(HERE, "tiny_gpt2.gguf"), "gpt2")
    w.add_name("tiny-gpt2")
    w.add_context_length(128)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.5)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "h\u00e9llo")
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", -1.25)
    w.add_array("test.array_i32", [1, -2, 3])
    w.add_array("test.array_f32", [0.25, -1.5])
    w.add_array("test.array_str", ["a", "", "\u00fc"])
    w.add_array("test.array_nested", [[1, 2], [3]])

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    w.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.add_tensor("blk.0.attn_norm.weight", np.array([1.0, -2.0, 0.5], dtype=np.float16))
    q = np.linspace(-1.0, 1.0, 2 * 64, dtype=np.float32).reshape(2, 64)
    w.add_tensor(
        "blk.0.ffn_up.weight",
        gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor("positions", np.array([[7, -7]], dtype=np.int32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
