"""A byte-level tokenizer with runtime/text.py's TextTokenizer interface, for the server's tests.

Each byte is its token id; the tiny test models have 128 tokens, so texts are ASCII. Decoding is
bytes -> UTF-8 with errors="replace"; the chat template is plain turns ("role: content" lines, then
"assistant:").
"""

from __future__ import annotations

import codecs


class ByteStream:
    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    def __init__(self, eos_ids=frozenset(), bos_id: int | None = None):
        self.eos_ids = frozenset(eos_ids)
        self.bos_id = bos_id

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_special_tokens and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.bos_id).decode("utf-8", errors="replace")

    def stream(self) -> ByteStream:
        return ByteStream()

    def chat_prompt(self, messages: list[dict]) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def chat_ids(self, messages: list[dict]) -> list[int]:  # runtime.text's rule for a tokenizer without a template
        return self.encode(self.chat_prompt(messages))
