"""The tokenizer a GGUF file's metadata describes, as the files `runtime.text` reads: `tokenizer.json` (built
with the `tokenizers` library), `tokenizer_config.json` (BOS / EOS / UNK / PAD tokens, add_bos_token, the chat
template) and `generation_config.json` (BOS id, EOS ids: eos, eot and eom where the file names them).

Two of llama.cpp's vocabulary types:
- `gpt2`: byte-level BPE over the file's merges, the text first split by the regexes llama.cpp uses for the
  file's `tokenizer.ggml.pre` (PRE_TOKENIZERS; an unknown name gets GPT-2's and a note); llama3's ignores the
  merges for words that are whole tokens, as llama.cpp does.
- `llama`: SentencePiece-style BPE: merges ranked by the merged piece's score, unknown characters as
  `<0xXX>` byte tokens (byte fallback), a space prefix where `tokenizer.ggml.add_space_prefix` says so.
Control tokens (token type 3) are special tokens (matched whole in text, left out of decoded text), user-defined
ones (4) are matched whole too. Anything else (another vocabulary type) writes no tokenizer and says why.
"""

from __future__ import annotations

import json
from pathlib import Path

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken (Nemo, Small 3, Pixtral), as its tokenizer.json writes it (llama.cpp spells the classes out)
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre's names of Llama 3's pre-tokenizer
LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "lfm2")
# tokenizer.ggml.pre -> the regexes llama.cpp (src/llama-vocab.cpp) splits text with, applied in turn
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    **{name: (GPT2,) for name in ("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion", "phi-2", "exaone4")},
    **{name: (r"\p{N}", GPT2) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                                            "minerva", "minerva-7b")},
    **{name: (LLAMA3,) for name in (*LLAMA3_NAMES, "dbrx", "smaug-bpe")},
    **{name: (QWEN2,) for name in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez")},
    "qwen35": (QWEN35,),
    "tekken": (TEKKEN,),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
}
# llama.cpp's tokenizer_ignore_merges: a word that is a whole token is that token
IGNORE_MERGES = {*LLAMA3_NAMES, "tekken"}
ADDS_BOS = set(LLAMA3_NAMES)  # llama.cpp adds BOS for these unless the file says otherwise
# tokenizer.ggml.model's names of the two vocabulary types (names of tokenizers, not of architectures)
BYTE_BPE = "gpt2"
SENTENCEPIECE = "llama"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (1 normal, 2 unknown, 5 unused, 6 byte)


def _get(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception:  # a damaged value reads as absent: the tokenizer is then refused below, not the model
        return default


def _special(tokenizer, tokens: list[str], types: list[int]) -> None:
    from tokenizers import AddedToken

    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    specials = [t for t in added if t.special]
    if specials:
        tokenizer.add_special_tokens(specials)
    others = [t for t in added if not t.special]
    if others:
        tokenizer.add_tokens(others)


def _bpe(tokens: list[str], merges: list[str], types: list[int], pre: str, notes: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges if " " in m]
    regexes = PRE_TOKENIZERS.get(pre)
    if regexes is None:
        notes.append(f"tokenizer.ggml.pre {pre!r} is unknown to picompile: GPT-2's pre-tokenizer is used, so "
                     "some texts may tokenize differently from llama.cpp")
        regexes = PRE_TOKENIZERS["gpt-2"]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in IGNORE_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    _special(tokenizer, tokens, types)
    return tokenizer


def _spm(tokens: list[str], scores: list[float], types: list[int], unk: int | None, space_prefix: bool):
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {token: index for index, token in enumerate(tokens)}
    # SentencePiece BPE merges the adjacent pair whose merged piece scores highest: rank every split of
    # every normal piece into two pieces by the merged piece's score
    ranked = []
    for index, token in enumerate(tokens):
        if types[index] not in (1, 0):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, vocab[left], (left, right)))
    merges = [pair for *_, pair in sorted(ranked)]
    unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk_token, byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tail = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *tail])
    _special(tokenizer, tokens, types)
    return tokenizer


def write_tokenizer(reader, path: Path, directory: Path, vocab_size: int, log=lambda message: None) -> list[str]:
    """Write the file's tokenizer into `directory` (nothing where the metadata has none, or one of another
    kind); returns notes for the user (why there is no tokenizer, an unknown pre-tokenizer)."""
    notes: list[str] = []
    kind = _get(reader, "tokenizer.ggml.model")
    tokens = _get(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        notes.append(f"{path.name} has no tokenizer in its metadata: the artifact runs on token ids only")
        return notes
    if len(tokens) > vocab_size:
        notes.append(f"the tokenizer in {path.name} has {len(tokens)} tokens but the model's vocabulary is "
                     f"{vocab_size}: no tokenizer is kept")
        return notes
    types = list(_get(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        types = [1] * len(tokens)
    if kind == BYTE_BPE:
        merges = _get(reader, "tokenizer.ggml.merges", [])
        pre = _get(reader, "tokenizer.ggml.pre", "default") or "default"
        tokenizer = _bpe(tokens, merges, types, pre, notes)
        add_bos_default = pre in ADDS_BOS
    elif kind == SENTENCEPIECE:
        scores = _get(reader, "tokenizer.ggml.scores", [0.0] * len(tokens))
        tokenizer = _spm(tokens, list(scores), types, _get(reader, "tokenizer.ggml.unknown_token_id"),
                         bool(_get(reader, "tokenizer.ggml.add_space_prefix", True)))
        add_bos_default = True
    else:
        notes.append(f"tokenizer type {kind!r} of {path.name} is not supported ({BYTE_BPE} and {SENTENCEPIECE} "
                     "are): the artifact runs on token ids only")
        return notes
    tokenizer.save(str(directory / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = _get(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    config = {f"{name}_token": token(name) for name in ("bos", "eos", "unk", "pad") if token(name) is not None}
    config["add_bos_token"] = bool(_get(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
    config["add_eos_token"] = bool(_get(reader, "tokenizer.ggml.add_eos_token", False))
    template = _get(reader, "tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    ids = {key: _get(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "eot", "eom")}
    eos = [ids[key] for key in ("eos", "eot", "eom") if isinstance(ids[key], int)]
    generation = {"bos_token_id": ids["bos"]} if isinstance(ids["bos"], int) else {}
    if eos:
        generation["eos_token_id"] = sorted(set(eos))
    (directory / "generation_config.json").write_text(json.dumps(generation))
    log(f"tokenizer: {kind} with {len(tokens)} tokens from the file's metadata")
    return notes
