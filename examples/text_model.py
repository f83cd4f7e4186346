"""A small OPT-ReLU decoder *trained* on real text: the Python standard library's own sources.

The synthetic models of examples/models.py have the sparsity and predictability their maker designed; this
one has what training gave it. Nothing is downloaded: the corpus is the ``*.py`` files under
``sysconfig.get_paths()['stdlib']`` of the running interpreter (tests, IDLE, lib2to3, tkinter demos and
site-packages left out, so that installed packages never change it), split by file, deterministically:
a file is held out when the first byte of the sha256 of its relative path is below HELDOUT_SHARE * 256, so
the held-out text is code the model never saw (not just other windows of the same files).

Tokenizer (:class:`Vocabulary`, a preset's ``vocab``): bytes (ids 0..255 are the UTF-8 bytes) plus ``BOS``
(256, also EOS: it separates files) and ``PAD`` (257, never produced; OPT zeroes its embedding row). It needs
nothing installed and round-trips any text exactly (:func:`encode` / :func:`decode`). Or, with ``vocab=N``, a
byte-level BPE of N tokens that the `tokenizers` library trains on the training files in seconds (BOS 0,
PAD 1; any text still round-trips, through byte tokens where no merge applies): the same compute then
trains on ~3x the text, and a token is a piece of code (``return``, ``self``, an indentation). The model directory also holds it as the `tokenizers`
library's files (:func:`write_tokenizer`: tokenizer.json, tokenizer_config.json, generation_config.json,
with BOS/EOS written ``<|endoftext|>`` and PAD ``<|pad|>``, text the corpus does not hold), so that
``picompile build`` copies it into the artifact and ``picompile run -p`` / runtime/text.py speak text: the
same ids as :func:`encode` for any text but those two strings, which that library reads as the special
tokens themselves, as every HF tokenizer does.

Model: ``transformers.OPTForCausalLM`` with ``activation_function="relu"`` (examples/models.py's OPT family,
so its exporter and picompile's recogniser handle it), trained from a fixed seed for a fixed number of
AdamW steps (linear warm-up, cosine decay) on random windows of the training stream; FFN sparsity is
whatever the ReLU FFNs learn, measured on the held-out windows afterwards (models.measure_sparsity).

Presets (TEXT_PRESETS): ``tiny`` (tests: seconds), ``code`` (the quickstart's: a 2,048-token BPE, hidden 256,
4 layers, FFN 1024, context 128 tokens, 3.7M parameters, 1,500 steps of 16 windows; measured below) and
``small`` (bytes; hidden 256, 4 layers, FFN 1024, context 256, 3.3M parameters, 800 steps of 8 windows =
1.6M bytes seen). Measured 2026-12-01 (torch 2.13, Python
3.11 stdlib: 512 training files, 9.3M bytes; 65 held out, 1.7M bytes): 0.64 CPU-seconds a step on one
thread, so about 9 minutes on one idle core (27 minutes wall at nice 10 on a 2-core machine loaded ~8, one
thread: two threads were several times slower there); held-out loss 5.54 -> 2.08 nats/byte (perplexity
255 -> 8.0); learned FFN sparsity per layer 0.70, 0.93, 0.96, 0.95 on the held-out windows (top-20%
neurons carry 35%, 65%, 71%, 75% of the activations), and greedy generation repeats indentation. The `code`
preset, measured 2026-12-02 on two threads of a 2-core machine: 3.17 bytes per token on the held-out files,
0.6 s a step (939 s), held-out loss 7.65 -> 4.31 nats/token = 1.36 nats/byte, learned FFN sparsity 0.59, 0.93,
0.92, 0.88; sampled at temperature 0.7 it writes Python's shape (keywords, names, indentation, docstrings), not
code that means anything. :func:`cached_text_model` trains once per configuration into
``cache_dir()/models/text-opt-<preset>-<hash12>/`` with the files every model directory has (model.onnx,
calib.npy: windows of the training files, heldout.npy: windows of the held-out files, config.json with the
training record, losses and measured sparsity; the tokenizer files), so ``picompile build model.onnx --calib
calib.npy`` and the benchmarks take it like any other; :class:`examples.models.ModelFiles` reads it.

    python examples/text_model.py [--preset small|code|tiny] [--steps N]   # trains (or finds) it, prints its record
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import models  # noqa: E402
from examples.byte_tokenizer import BOS, PAD, VOCAB, byte_tokenizer, write_tokenizer_files  # noqa: E402  BOS is EOS

TEXT_MAKER_VERSION = "1"
BOS_TEXT, PAD_TEXT = "<|endoftext|>", "<|pad|>"  # the special tokens in tokenizer.json
HELDOUT_SHARE = 0.1
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "ensurepip"}

# Architecture fields (OPTConfig names) and training budget per preset. `context` is both the training window
# and max_position_embeddings (positions past it would be untrained); held-out / calibration files hold
# `n_seqs` windows of `context` tokens (`calib_seqs` may shrink the calibration file, as for models.py).
TEXT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, ffn_dim=128, num_attention_heads=2, context=64,
                 steps=40, batch=8, lr=3e-3, n_seqs=8, calib_seqs=None, vocab=None),
    "small": dict(hidden_size=256, num_hidden_layers=4, ffn_dim=1024, num_attention_heads=4, context=256,
                  steps=800, batch=8, lr=2e-3, n_seqs=32, calib_seqs=None, vocab=None),
    # the quickstart's: a byte-level BPE of `vocab` tokens (trained on the training files) spends the same
    # compute on ~3x the text of bytes, and its tokens (`return`, `self.`, an indentation) are code's words
    "code": dict(hidden_size=256, num_hidden_layers=4, ffn_dim=1024, num_attention_heads=4, context=128,
                 steps=1500, batch=16, lr=3e-3, n_seqs=32, calib_seqs=None, vocab=2048),
}
ARCH_KEYS = ("hidden_size", "num_hidden_layers", "ffn_dim", "num_attention_heads")
BPE_BOS, BPE_PAD = 0, 1  # a trained BPE's special ids: its trainer numbers the special tokens first
WARMUP_SHARE = 0.05
MIN_LR_SHARE = 0.1  # cosine decay ends at this share of the peak learning rate
WEIGHT_DECAY = 0.01
CLIP_NORM = 1.0

__all__ = ["encode", "decode", "write_tokenizer", "corpus_files", "corpus_digest", "split_files", "token_stream",
           "windows", "text_config", "train", "heldout_loss", "make_text_model", "cached_text_model",
           "text_config_hash"]


# ----------------------------------------------------------------------------- tokenizer


def encode(text: str, bos: bool = False) -> np.ndarray:
    """UTF-8 bytes as int64 ids (``BOS`` first when asked)."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    return np.concatenate([[BOS], ids]).astype(np.int64) if bos else ids


def decode(ids) -> str:
    """The text of byte ids; special ids (BOS, PAD) are dropped, broken UTF-8 replaced (a sampled byte
    sequence need not be valid UTF-8)."""
    data = bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256)
    return data.decode("utf-8", errors="replace")


class Vocabulary:
    """How a preset's text becomes ids: UTF-8 bytes (``vocab`` None: :func:`encode`, and
    examples/byte_tokenizer.py's tokenizer.json), or a byte-level BPE of ``vocab`` tokens that the `tokenizers`
    library trains on the training files (GPT-2's pre-tokenizer: runs of spaces, words with their leading
    space). Either way ``bos`` (also EOS) starts every file and ``pad`` is never produced."""

    def __init__(self, tokenizer, kind: str, bos: int, pad: int):
        self.tokenizer, self.kind, self.bos, self.pad = tokenizer, kind, bos, pad
        self.size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def bytes(cls) -> "Vocabulary":
        return cls(byte_tokenizer(BOS_TEXT, PAD_TEXT), "bytes", BOS, PAD)

    @classmethod
    def bpe(cls, texts: list[str], size: int) -> "Vocabulary":
        """A BPE of `size` tokens trained on `texts` (deterministic: the same texts give the same merges)."""
        from tokenizers import Tokenizer, decoders, models as bpe_models, pre_tokenizers, processors, trainers

        tokenizer = Tokenizer(bpe_models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=size, special_tokens=[BOS_TEXT, PAD_TEXT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # every byte: any text encodes
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS_TEXT} $A",
                                                                 special_tokens=[(BOS_TEXT, BPE_BOS)])
        return cls(tokenizer, "bpe", BPE_BOS, BPE_PAD)

    def stream(self, texts: list[str]) -> np.ndarray:
        """The texts' ids, each text preceded by BOS, as one int64 stream."""
        parts = self.encode_texts(texts)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids, BOS first (int64)."""
        if self.kind == "bytes":
            return [encode(text, bos=True) for text in texts]
        return [np.asarray(e.ids, np.int64) for e in self.tokenizer.encode_batch(texts, add_special_tokens=True)]

    def write(self, directory: str | os.PathLike, context: int) -> Path:
        """The model's tokenizer files in ``directory`` (examples/byte_tokenizer.py `write_tokenizer_files`)."""
        return write_tokenizer_files(Path(directory), self.tokenizer, bos=BOS_TEXT, pad=PAD_TEXT, bos_id=self.bos,
                                     pad_id=self.pad, model_max_length=context)


def write_tokenizer(directory: str | os.PathLike, context: int) -> Path:
    """The byte vocabulary as a model's tokenizer files in ``directory``."""
    return Vocabulary.bytes().write(directory, context)


# ----------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """The corpus' files, relative to the stdlib root, sorted (the order everything else derives from)."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not EXCLUDED_DIRS & set(rel.parts[:-1]) and path.is_file():
            files.append(rel)
    return sorted(files, key=lambda p: p.as_posix())


def corpus_digest(root: Path | None = None) -> str:
    """What identifies the corpus cheaply: the Python version and every file's path and size (another
    interpreter's stdlib is other text, so another cached model)."""
    root = root or stdlib_root()
    digest = hashlib.sha256(f"python {sys.version_info[0]}.{sys.version_info[1]}\0".encode())
    for rel in corpus_files(root):
        digest.update(f"{rel.as_posix()}\0{(root / rel).stat().st_size}\0".encode())
    return digest.hexdigest()


def split_files(files: list[Path], heldout_share: float = HELDOUT_SHARE) -> tuple[list[Path], list[Path]]:
    """(training, held-out) by a hash of each path: stable under files added or removed elsewhere."""
    cut = int(heldout_share * 256)
    held = [f for f in files if hashlib.sha256(f.as_posix().encode()).digest()[0] < cut]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def file_texts(files: list[Path], root: Path | None = None) -> list[str]:
    """The files' text (undecodable files are skipped: the stdlib has a few latin-1 test fixtures, and text
    the tokenizer round-trips is what the model trains on)."""
    root = root or stdlib_root()
    texts = []
    for rel in files:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def token_stream(files: list[Path], root: Path | None = None, vocabulary: Vocabulary | None = None) -> np.ndarray:
    """The files' ids (bytes unless `vocabulary` says otherwise), each file preceded by BOS, as one int64
    stream."""
    return (vocabulary or Vocabulary.bytes()).stream(file_texts(files, root))


def windows(stream: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    """``n`` windows of ``length`` tokens at seeded random offsets, int64 [n, length]."""
    if len(stream) <= length:
        raise ValueError(f"a stream of {len(stream)} tokens has no window of {length}")
    starts = np.random.default_rng(seed).integers(0, len(stream) - length, size=n)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int64)


# ----------------------------------------------------------------------------- model and training


def _settings(preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if preset not in TEXT_PRESETS:
        raise ValueError(f"unknown text preset {preset!r}; expected one of {sorted(TEXT_PRESETS)}")
    unknown = set(overrides) - set(TEXT_PRESETS[preset])
    if unknown:
        raise ValueError(f"unknown text model settings {sorted(unknown)}; expected some of {sorted(TEXT_PRESETS[preset])}")
    return {**TEXT_PRESETS[preset], **overrides}


def text_config(settings: dict[str, Any], vocabulary: Vocabulary):
    """The OPTConfig: examples/models.py's OPT family (ReLU, pre-LN, biases, tied head) at these sizes."""
    return models.make_config("opt", "tiny", **{k: settings[k] for k in ARCH_KEYS}, vocab_size=vocabulary.size,
                              max_position_embeddings=settings["context"], pad_token_id=vocabulary.pad,
                              bos_token_id=vocabulary.bos, eos_token_id=vocabulary.bos)


def heldout_loss(model, ids: np.ndarray, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats per byte) over windows ``ids`` [n, len]."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), batch):
            chunk = torch.as_tensor(ids[start:start + batch])
            logits = model(input_ids=chunk, attention_mask=torch.ones_like(chunk), use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     chunk[:, 1:].reshape(-1), reduction="sum")
            total, count = total + float(loss), count + chunk[:, 1:].numel()
    return total / max(count, 1)


def train(model, stream: np.ndarray, settings: dict[str, Any], seed: int, log=lambda message: None) -> list[float]:
    """AdamW on seeded random windows of ``stream`` for ``settings['steps']`` steps; returns the training loss
    per step. Linear warm-up then cosine decay (a fixed budget, so a fixed schedule)."""
    steps, batch, context, peak = settings["steps"], settings["batch"], settings["context"], settings["lr"]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]  # no decay on norms and biases
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimiser = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": rest, "weight_decay": 0.0}], lr=peak, betas=(0.9, 0.95))
    warmup = max(1, int(WARMUP_SHARE * steps))

    def rate(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return MIN_LR_SHARE + (1 - MIN_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, rate)
    rng = np.random.default_rng(seed + 4001)
    losses = []
    model.train()
    started = time.perf_counter()
    for step in range(steps):
        starts = rng.integers(0, len(stream) - context, size=batch)
        chunk = torch.as_tensor(np.stack([stream[s:s + context] for s in starts]))
        out = model(input_ids=chunk, attention_mask=torch.ones_like(chunk), labels=chunk, use_cache=False)
        optimiser.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        optimiser.step()
        schedule.step()
        losses.append(out.loss.item())
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps}: loss {losses[-1]:.3f} ({time.perf_counter() - started:.0f}s)")
    model.eval()
    return losses


def text_config_hash(preset: str = "small", seed: int = 0, **overrides) -> str:
    settings = _settings(preset, overrides)
    if settings["vocab"] is None:  # byte models keep the names they had before the BPE option
        del settings["vocab"]
    key = dict(text_maker_version=TEXT_MAKER_VERSION, maker_version=models.MAKER_VERSION, preset=preset, seed=seed,
               settings=settings, heldout_share=HELDOUT_SHARE, excluded=sorted(EXCLUDED_DIRS),
               corpus=corpus_digest(), torch=torch.__version__.split("+")[0])
    if settings.get("vocab"):  # a trained BPE's merges are the tokenizers library's
        import tokenizers

        key["tokenizers"] = tokenizers.__version__
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def make_text_model(out_dir: str | os.PathLike, preset: str = "small", seed: int = 0, threads: int | None = None,
                    log=lambda message: None, **overrides) -> models.ModelFiles:
    """Train, measure, export and write the text model into ``out_dir`` (see the module docstring)."""
    import transformers

    settings = _settings(preset, overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    train_files, held_files = split_files(corpus_files())
    train_texts, held_texts = file_texts(train_files), file_texts(held_files)  # read once: ~11 MB
    vocabulary = Vocabulary.bpe(train_texts, settings["vocab"]) if settings["vocab"] else Vocabulary.bytes()
    train_stream, held_stream = vocabulary.stream(train_texts), vocabulary.stream(held_texts)
    context, n_seqs = settings["context"], settings["n_seqs"]
    calib = windows(train_stream, settings["calib_seqs"] or n_seqs, context, seed + 2001)
    heldout = windows(held_stream, n_seqs, context, seed + 3001)
    calib_path = models.write_tokens(out_dir / "calib.npy", calib)
    heldout_path = models.write_tokens(out_dir / "heldout.npy", heldout)
    held_bytes = sum(len(text.encode("utf-8")) for text in held_texts)
    bytes_per_token = held_bytes / max(1, len(held_stream) - len(held_texts))  # the BOS per text is no text
    log(f"corpus: {len(train_files)} training files ({len(train_stream) / 1e6:.2f}M tokens), "
        f"{len(held_files)} held out ({len(held_stream) / 1e6:.2f}M tokens); {vocabulary.kind} vocabulary of "
        f"{vocabulary.size}, {bytes_per_token:.2f} bytes per token")

    config = text_config(settings, vocabulary)
    torch.manual_seed(seed)
    model = transformers.OPTForCausalLM(config)
    loss_init = heldout_loss(model, heldout)
    trained_at = time.perf_counter()
    losses = train(model, train_stream, settings, seed, log)
    train_s = time.perf_counter() - trained_at
    loss_final = heldout_loss(model, heldout)
    measured = models.measure_sparsity(model, heldout)
    log(f"trained {models.num_params(model) / 1e6:.2f}M params for {settings['steps']} steps in {train_s:.0f}s: "
        f"held-out loss {loss_init:.3f} -> {loss_final:.3f} nats/token "
        f"({loss_final / bytes_per_token:.3f} nats/byte); learned FFN sparsity "
        f"{[round(s, 3) for s in measured['per_layer']]}")
    exported_at = time.perf_counter()
    onnx_path = models.export_onnx(model, out_dir, "dynamo", metadata={
        "picompile.family": "opt", "picompile.preset": f"text-{preset}", "picompile.seed": str(seed),
        "picompile.synthetic_sparsity": "none (trained on text)", "picompile.maker_version": models.MAKER_VERSION,
        "picompile.text_maker_version": TEXT_MAKER_VERSION})
    inputs, outputs = models.io_names(config)
    _, kv_heads, head_dim = models._kv_shape(config)
    meta = dict(
        maker_version=models.MAKER_VERSION, text_maker_version=TEXT_MAKER_VERSION, family="opt",
        preset=f"text-{preset}", seed=seed, exporter="dynamo", opset=18, overrides=overrides,
        num_params=models.num_params(model), predictability=None,
        calib_tokens=int(calib.size),
        tokenizer=dict(kind=vocabulary.kind, vocab_size=vocabulary.size, bos=vocabulary.bos, eos=vocabulary.bos,
                       pad=vocabulary.pad, bytes_per_token=bytes_per_token,
                       note=("ids 0..255 are UTF-8 bytes (examples/text_model.py encode/decode)"
                             if vocabulary.kind == "bytes" else "byte-level BPE trained on the training files")),
        corpus=dict(source="Python standard library *.py", python=sys.version.split()[0], root=str(stdlib_root()),
                    excluded_dirs=sorted(EXCLUDED_DIRS), heldout_share=HELDOUT_SHARE, digest=corpus_digest(),
                    train_files=len(train_files), heldout_files=len(held_files),
                    train_tokens=int(len(train_stream)), heldout_tokens=int(len(held_stream)),
                    heldout_examples=[f.as_posix() for f in held_files[:10]]),
        training=dict(settings=settings, threads=torch.get_num_threads(), seconds=train_s,
                      tokens_seen=settings["steps"] * settings["batch"] * context,
                      loss_first=losses[0], loss_last=losses[-1],
                      loss_every_tenth=[losses[i] for i in range(0, len(losses), max(1, len(losses) // 10))]),
        heldout_loss=dict(untrained=loss_init, trained=loss_final, unit="nats per token, heldout.npy",
                          trained_per_byte=loss_final / bytes_per_token,
                          ppl_untrained=math.exp(loss_init), ppl_trained=math.exp(loss_final)),
        synthetic_sparsity=None,
        measured_sparsity=dict(on="heldout.npy", tokens=measured["tokens"], mean=measured["mean"],
                               per_layer=measured["per_layer"], top20_share=measured["top20_share"], checks=None,
                               note="learned by training (ReLU FFN), not designed"),
        onnx=dict(inputs=inputs, outputs=outputs, kv_heads=kv_heads, head_dim=head_dim,
                  num_layers=config.num_hidden_layers, position_ids=False, empty_past_ok=True),
        files=dict(onnx=onnx_path.name, calib=calib_path.name, heldout=heldout_path.name, stats=None),
        timing_s=dict(data=trained_at - started, train=train_s, export=time.perf_counter() - exported_at),
        hf_config=config.to_dict(),
    )
    vocabulary.write(out_dir, context)
    (out_dir / "config.json").write_text(json.dumps(meta, indent=1, default=models._json_default) + "\n")
    return models.ModelFiles.from_dir(out_dir)


def cached_text_model(preset: str = "small", seed: int = 0, threads: int | None = None, log=lambda message: None,
                      **overrides) -> models.ModelFiles:
    """Train once per configuration (preset, settings, seed, corpus, maker versions; not `threads`) into
    ``cache_dir()/models/text-opt-<preset>-<hash12>/`` and reuse it afterwards. A directory trained before
    the tokenizer files were written gets them here (they depend on the vocabulary only, not the training)."""
    final = models.cache_dir() / "models" / f"text-opt-{preset}-{text_config_hash(preset, seed, **overrides)[:12]}"
    models.build_cached(final, lambda work: make_text_model(work, preset, seed, threads, log, **overrides))
    settings = _settings(preset, overrides)
    if settings["vocab"] is None and not (final / "tokenizer.json").is_file():  # a BPE's is written as it is trained
        write_tokenizer(final, settings["context"])
    return models.ModelFiles.from_dir(final)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(TEXT_PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for training")
    args = parser.parse_args(argv)
    overrides = {} if args.steps is None else {"steps": args.steps}
    files = cached_text_model(args.preset, args.seed, args.threads, log=print, **overrides)
    meta = json.loads(files.config.read_text())
    print(json.dumps({"dir": str(files.dir), "num_params": meta["num_params"], "heldout_loss": meta["heldout_loss"],
                      "training_s": meta["training"]["seconds"], "sparsity": meta["measured_sparsity"]["per_layer"]},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
