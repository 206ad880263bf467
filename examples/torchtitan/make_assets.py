"""Make the tiny tokenizer and dataset the example configs train on (no download).

    python examples/torchtitan/make_assets.py            # writes examples/torchtitan/assets/

assets/tokenizer/   tokenizer.json + tokenizer_config.json: a word-level tokenizer of 2,000
                    entries (<|begin_of_text|> = 0, <|end_of_text|> = 1, <unk> = 2, then words),
                    within the llama3 debug model's vocab_size of 2048. torchtitan's
                    HuggingFaceTokenizer loads it from [model] hf_assets_path.
assets/c4_tiny/     data.jsonl: 1,200 documents {"text": ...} of 20-400 words drawn from a
                    seeded Markov chain (so there is something to learn). torchtitan loads it as
                    the "c4_test" dataset from [training] dataset_path, packs documents
                    separated by EOS into seq_len windows and loops over it.

Deterministic: the same files on every machine (pure Python RNG; the tokenizer is written as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
N_WORDS = 1997  # + 3 special tokens = 2000 <= 2048
N_DOCS = 1200


def make_words(rng: random.Random) -> list[str]:
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    while len(words) < N_WORDS:
        n = rng.choice((1, 2, 2, 3))
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(n)))
    return sorted(words)


def make_documents(rng: random.Random, words: list[str]) -> list[str]:
    # Each word has 4 likely successors: a first-order Markov chain with a little noise.
    successors = {w: rng.sample(words, 4) for w in words}
    docs = []
    for _ in range(N_DOCS):
        w = rng.choice(words)
        out = [w]
        for _ in range(rng.randint(20, 400) - 1):
            w = rng.choice(successors[w]) if rng.random() < 0.9 else rng.choice(words)
            out.append(w)
        docs.append(" ".join(out))
    return docs


def tokenizer_json(vocab: dict[str, int]) -> dict:
    special = [
        {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t in (BOS, EOS, UNK)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(here, "assets"))
    out = p.parse_args().out

    rng = random.Random(1234)
    words = make_words(rng)
    vocab = {BOS: 0, EOS: 1, UNK: 2, **{w: i + 3 for i, w in enumerate(words)}}

    tok_dir = os.path.join(out, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    with open(os.path.join(tok_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(vocab), f)
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
                   "add_bos_token": True, "add_eos_token": True}, f, indent=1)

    data_dir = os.path.join(out, "c4_tiny")
    os.makedirs(data_dir, exist_ok=True)
    docs = make_documents(rng, words)
    with open(os.path.join(data_dir, "data.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    n_tokens = sum(len(d.split()) + 2 for d in docs)
    print(f"wrote {tok_dir} ({len(vocab)} tokens) and {data_dir} ({len(docs)} documents, {n_tokens:,} tokens)")


if __name__ == "__main__":
    main()
