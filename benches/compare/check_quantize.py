#!/usr/bin/env python3
"""By-hand check (not CI) that llama.cpp loads and runs what `metrale
quantize` writes, and agrees with metrale on it.

    benches/compare/.venv/bin/python benches/compare/check_quantize.py \
        [--metrale target/debug/metrale] [--types bf16,q8_0,q4_k_m,q5_k_m,q6_k]

For each safetensors fixture (tests/fixtures/<model>, laid out as llama.cpp's
converter saw it for tests/fixtures/gguf-bf16: that directory's tokenizer.json
and configs/) and each type:
1. `metrale quantize DIR OUT --type T --pre-tokenizer gpt-2`;
2. llama.cpp (llama-cpp-python's Llama, CPU, one thread) loads OUT and
   greedy-decodes 16 tokens after PROMPT (its own argmax loop, EOS ignored);
3. `metrale generate --model OUT --temperature 0 -n 16 --ignore-eos PROMPT`:
   its text (less the newline it ends with) is compared with llama.cpp's 16
   tokens decoded;
4. `metrale logits --model OUT` over the prompt and llama.cpp's 16 tokens:
   the argmax at each position is compared with llama.cpp's next token
   (teacher-forced token agreement);
5. llama.cpp's own file for the same (model, type): its converter
   (tests/fixtures/gguf-bf16/convert.py, `--outtype T`, or `f32` then
   `llama_model_quantize` for a quantized T, as gen_quantized.py does),
   greedy-decoded by llama.cpp as in 2: its 16 tokens are compared with
   those of 2, and its tensors (names, types, shapes, bytes) with OUT's.
Prints one line per (model, type).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures"
MODELS = ["llama", "qwen3", "mamba2", "bamba", "nemotron_h", "granitemoehybrid", "qwen3_next",
          "nemotron_h_moe"]
GGUF_BF16 = FIXTURES / "gguf-bf16"
sys.path.insert(0, str(GGUF_BF16))
from gen_quantized import DEFAULT_LLAMA_SRC, FORMATS, quantize  # noqa: E402
PROMPT = "The quick brown fox"
N = 16


def converter_input(model: str, dst: Path):
    dst.mkdir(parents=True)
    for n in ["model.safetensors", "generation_config.json", "tokenizer_config.json"]:
        shutil.copy(FIXTURES / model / n, dst / n)
    shutil.copy(FIXTURES / "gguf-bf16/tokenizer.json", dst / "tokenizer.json")
    special = FIXTURES / "gguf-bf16/configs" / f"{model}.json"
    shutil.copy(special if special.exists() else FIXTURES / model / "config.json",
                dst / "config.json")


def llama_cpp_greedy(path: Path):
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, n_threads_batch=1,
                          logits_all=True, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False, special=False)
    llm.eval(prompt)
    out = []
    for _ in range(N):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    text = llm.detokenize(out).decode("utf-8", errors="replace")
    return prompt, out, text


def llama_cpp_file(llama_src: Path, src: Path, ty: str, out: Path):
    """llama.cpp's own conversion of `src` as `ty` (see step 5)."""
    outtype = ty if ty in ("f32", "f16", "bf16") else "f32"
    conv = out.with_suffix(f".{outtype}.gguf")
    subprocess.run([sys.executable, str(GGUF_BF16 / "convert.py"), str(llama_src), str(src),
                    str(conv), outtype], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    if outtype == ty:
        conv.rename(out)
    else:
        quantize(conv, out, FORMATS[ty])
        conv.unlink()


def same_tensors(a: Path, b: Path, llama_src: Path) -> bool:
    sys.path.insert(0, str(llama_src / "gguf-py"))
    import gguf

    def tensors(p):
        return [(t.name, t.tensor_type, list(t.shape), bytes(t.data))
                for t in gguf.GGUFReader(str(p)).tensors]
    return tensors(a) == tensors(b)


def reference(llama_src: Path, src: Path, ty: str, ours: Path, toks) -> str:
    theirs = ours.with_name(ours.stem + "-llama-cpp.gguf")
    llama_cpp_file(llama_src, src, ty, theirs)
    _, their_toks, _ = llama_cpp_greedy(theirs)
    same = "same tokens" if their_toks == toks else f"tokens differ ({their_toks} vs {toks})"
    files = "same tensors" if same_tensors(ours, theirs, llama_src) else "tensors differ"
    theirs.unlink()
    return f"{same}, {files}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--metrale", type=Path, default=ROOT / "target/debug/metrale")
    ap.add_argument("--types", default="bf16,q8_0,q4_k_m,q5_k_m,q6_k")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--llama-src", type=Path, default=DEFAULT_LLAMA_SRC)
    args = ap.parse_args()
    from safetensors.numpy import load_file

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model in args.models.split(","):
            src = tmp / f"src_{model}"
            converter_input(model, src)
            for ty in args.types.split(","):
                out = tmp / f"{model}-{ty}.gguf"
                r = subprocess.run([str(args.metrale), "-q", "quantize", str(src), str(out),
                                    "--type", ty, "--pre-tokenizer", "gpt-2"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    rows.append((model, ty, "quantize failed: " + r.stderr.strip(), "", "", ""))
                    continue
                try:
                    prompt, toks, ltext = llama_cpp_greedy(out)
                    load = "ok"
                except Exception as e:  # noqa: BLE001 - reported, not hidden
                    rows.append((model, ty, f"llama.cpp failed: {e}", "", "", ""))
                    continue
                g = subprocess.run([str(args.metrale), "-q", "generate", "--model", str(out),
                                    "--threads", "1", "--temperature", "0", "-n", str(N),
                                    "--ignore-eos", PROMPT], capture_output=True, text=True)
                mtext = g.stdout if g.returncode == 0 else "<failed: " + g.stderr.strip() + ">"
                # generate ends its output with a newline of its own.
                mtext = mtext.removesuffix("\n")
                text_eq = "equal" if mtext == ltext else f"differ ({mtext!r} vs {ltext!r})"
                ids = prompt + toks
                lo = tmp / "logits.safetensors"
                r = subprocess.run([str(args.metrale), "-q", "logits", "--model", str(out),
                                    "--threads", "1", "--ids", ",".join(map(str, ids)),
                                    "--out", str(lo)], capture_output=True, text=True)
                if r.returncode != 0:
                    agree = "logits failed: " + r.stderr.strip()
                else:
                    logits = load_file(str(lo))["logits"]
                    am = logits.argmax(axis=1)
                    got = [int(am[len(prompt) - 1 + i]) for i in range(N)]
                    same = sum(int(a == b) for a, b in zip(got, toks))
                    agree = f"{same}/{N}"
                ref = reference(args.llama_src, src, ty, out, toks)
                rows.append((model, ty, load, text_eq, agree, ref))
                print(model, ty, load, text_eq, agree, ref, file=sys.stderr)
    print("| model | type | llama.cpp load | greedy text (metrale generate vs llama.cpp) "
          "| teacher-forced argmax agreement | llama.cpp's own file vs OUT |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
