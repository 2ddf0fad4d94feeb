"""Write tests/fixtures/llama_cpp_tokens.json: llama.cpp's own tokenization of ~150 varied texts, per vocabulary.

    .venv-llama/bin/python tools/make_tokenizer_fixture.py /path/to/llama_cpp_python-0.3.36.tar.gz [SMOLLM2.gguf]

llama.cpp's test vectors (the .inp/.out files beside its vocab GGUFs) are 46 short cases each; this adds texts they
do not have: code, prose, random mixes of scripts, emoji, digits, spaces and punctuation, and special-token markers,
tokenized by llama-cpp-python 0.3.36 (`Llama.tokenize`, no BOS) both with special tokens read as text
(parse_special=False) and as markers (True). tests/test_gguf_tokenizer.py checks tinyserve against it.
Needs only llama-cpp-python (runs in .venv-llama).
"""
from __future__ import annotations

import argparse
import json
import random
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
VOCABS = ("llama-bpe", "llama-spm", "qwen2", "gpt-2", "phi-3")
POOLS = ["abc XYZ", " \t\n\r", "0123456789", "'sdtmlrve", ".,;:!?()[]{}<>\"'`~@#$%^&*-_=+|\\/", "éàüßçñøåæœ",
         "日本語中文한국어", "😀🚀👍🏽🇫🇷🦙", "\u00a0\u2009\u3000\u200b", "ΑΒΓαβγ Кириллица", "ـعربيةעברית", "\u0301\u0308"]
FIXED = ["  leading", "trailing   ", "a  b   c    d", "x = 1_000_000.5e-3", "don't WON'T I'M they'RE", "\n\n\n\n",
         "1234567890123", "<|im_start|>user\nHi<|im_end|>\n", "<s>[INST] hi [/INST]", "</s> after", "<|endoftext|>x",
         "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", "<|end|>\n<|assistant|>"]


def texts(source_code: str, prose: str) -> list[str]:
    rng = random.Random(0)
    out = [source_code[i:i + 300] for i in range(0, 30000, 6000)] + [prose[i:i + 300] for i in range(0, 3000, 600)]
    for _ in range(120):
        pool = "".join(rng.sample(POOLS, rng.randint(1, 4)))
        out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 40))))
    return out + FIXED


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sdist", type=Path)
    ap.add_argument("smollm2", type=Path, nargs="?", help="the shipped SmolLM2 GGUF (optional)")
    root = Path(__file__).resolve().parent.parent
    ap.add_argument("--out", type=Path, default=root / "tests" / "fixtures" / "llama_cpp_tokens.json")
    args = ap.parse_args()

    import llama_cpp

    with tempfile.TemporaryDirectory() as tmp, tarfile.open(args.sdist) as tar:
        names = {LLAMA_CPP + f"models/ggml-vocab-{v}.gguf": v for v in VOCABS}
        names[LLAMA_CPP + "src/llama-vocab.cpp"] = "code"
        paths = {}
        for member in tar:
            if member.name in names:
                paths[names[member.name]] = Path(tmp) / Path(member.name).name
                paths[names[member.name]].write_bytes(tar.extractfile(member).read())
        all_texts = texts(paths.pop("code").read_text(encoding="utf-8"),
                          (root / "tests" / "fixtures" / "perplexity_text.txt").read_text(encoding="utf-8"))
        if args.smollm2:
            paths["smollm2"] = args.smollm2
        out = {"generated_by": f"tools/make_tokenizer_fixture.py, llama-cpp-python {llama_cpp.__version__}",
               "texts": all_texts, "vocabs": {}}
        for name, path in paths.items():
            llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            plain = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in all_texts]
            special = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in all_texts]
            out["vocabs"][name] = {   # ids as strings of numbers: a third of the JSON's size
                "plain": [" ".join(map(str, ids)) for ids in plain],
                "special": {str(i): " ".join(map(str, s)) for i, (p, s) in enumerate(zip(plain, special)) if s != p}}
            print(name, sum(map(len, plain)), "tokens")
    args.out.write_text(json.dumps(out, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
