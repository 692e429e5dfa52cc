#!/usr/bin/env python3
"""Convert a metrale random-weight checkpoint to GGUF with llama.cpp's own
convert_hf_to_gguf.py (from the llama-cpp-python source distribution).

The random checkpoints have no tokenizer. Both engines are fed token ids
directly, so the vocabulary's strings do not matter: this wrapper replaces
the converter's `set_vocab` with one that writes a synthetic SentencePiece-
style vocabulary of the config's size (256 byte tokens, then `<tN>`). Every
tensor and hyper-parameter goes through the converter unchanged.

usage: convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf {bf16,f32}
"""

import json
import sys
from pathlib import Path


def main() -> None:
    llama_dir, model_dir, out, outtype = sys.argv[1:5]
    sys.path.insert(0, str(Path(llama_dir) / "gguf-py"))
    sys.path.insert(0, str(llama_dir))
    import gguf  # noqa: E402  (llama.cpp's own copy, matching the converter)
    import convert_hf_to_gguf as conv  # noqa: E402

    hparams = json.loads((Path(model_dir) / "config.json").read_text())

    def synthetic_vocab(self) -> None:
        n = self.hparams["vocab_size"]
        tokens = [f"<0x{i:02X}>".encode() for i in range(min(256, n))]
        tokens += [f"<t{i}>".encode() for i in range(len(tokens), n)]
        types = [gguf.TokenType.BYTE] * min(256, n) + [gguf.TokenType.NORMAL] * (n - min(256, n))
        w = self.gguf_writer
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * n)
        w.add_token_types(types)
        eos = hparams.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        bos = hparams.get("bos_token_id")
        w.add_bos_token_id(bos if isinstance(bos, int) and bos < n else 1)
        w.add_eos_token_id(eos if isinstance(eos, int) and eos < n else 2)
        w.add_add_bos_token(False)

    if hparams.get("model_type") == "nemotron_h":
        # transformers fills in its NemotronH defaults, MoE keys included, and
        # the converter then takes a dense model for a MoE one; read the file
        # as written, as the converter does when transformers cannot.
        conv.ModelBase.load_hparams = staticmethod(lambda d, is_mistral_format=False: json.loads((Path(d) / "config.json").read_text()))

    original = conv.get_model_class

    def patched(*args, **kwargs):
        cls = original(*args, **kwargs)
        cls.set_vocab = synthetic_vocab  # this process converts one model only
        return cls

    conv.get_model_class = patched
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out), "--outtype", outtype]
    if hparams.get("model_type") in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        # The random checkpoints have no MTP layers (Qwen3-Next's configs do
        # not count them; Qwen3.5's bench configs leave them out).
        sys.argv.append("--no-mtp")
    conv.main()


if __name__ == "__main__":
    main()
