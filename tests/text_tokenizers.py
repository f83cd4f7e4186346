"""Tokenizer files for tests: examples/byte_tokenizer.py's byte-level tokenizer (what the text model uses),
with a small chat template."""

from __future__ import annotations

from examples.byte_tokenizer import BOS, PAD, VOCAB, byte_tokenizer, write_byte_tokenizer  # noqa: F401

# a small chat template in the usual style: turns marked by role, the special tokens as text
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
