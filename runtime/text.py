"""Text at the runtime's edges: the model's tokenizer, read from the artifact's `tokenizer/` with the
`tokenizers` library (jinja2 too, for a chat template), never transformers.

The files are those `save_pretrained` / optimum write: tokenizer.json (required), tokenizer_config.json,
special_tokens_map.json, generation_config.json, chat_template.jinja. What transformers layers on top of
tokenizer.json is taken from them here: the BOS / EOS tokens, `add_bos_token`, the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from .artifact import ArtifactError, load_manifest, sha256

TOKENIZER_DIR = "tokenizer"  # inside the artifact
TOKENIZER_FILE = "tokenizer.json"
# what is copied beside tokenizer.json when present; the rest of a model directory is not the tokenizer's
OPTIONAL_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
TOKENIZER_FILES = (TOKENIZER_FILE, *OPTIONAL_FILES)


class TextStream:
    """Incremental detokenization of one sequence. Each push returns the text its token completes: ""
    while a UTF-8 character (byte tokens) or a multi-token piece is unfinished. Exact: the pushes' outputs
    plus `flush()` are `decode(all ids)`, because the text decoded so far, less an unfinished last
    character (decoded as U+FFFD), is a prefix of what later ids decode to (true of byte-level BPE and of
    SentencePiece byte fallback, the decoders of decoder LLMs); each push decodes the whole sequence, a few
    microseconds per hundred tokens, against milliseconds per decode step."""

    def __init__(self, tokenizer: "TextTokenizer"):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0  # characters of decode(ids) already returned

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):  # unfinished bytes, or a real U+FFFD: either way it waits for the next token
            return ""
        return self._take(text)

    def flush(self) -> str:
        return self._take(self._tokenizer.decode(self._ids))

    def _take(self, text: str) -> str:
        new = text[self._emitted:]
        self._emitted = len(text)
        return new


class TextTokenizer:
    """A model's tokenizer: encode, decode, incremental decode, its special ids and its chat prompt."""

    def __init__(self, directory: Path):
        """Read the tokenizer files of `directory` (tokenizer.json and what of OPTIONAL_FILES is there).
        Raises ValueError naming the file that cannot be read."""
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the library's own exception types
            message = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
            raise ValueError(f"{path} is not a tokenizer the tokenizers library reads: {message}") from None
        config = _json(directory / "tokenizer_config.json")
        special = _json(directory / "special_tokens_map.json")
        generation = _json(directory / "generation_config.json")
        self.config = config
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_text(config.get("bos_token", special.get("bos_token")))
        self.eos_token = _token_text(config.get("eos_token", special.get("eos_token")))
        bos = generation.get("bos_token_id")
        self.bos_id: int | None = (bos if isinstance(bos, int) and not isinstance(bos, bool)
                                   else self._id_of(self.bos_token))
        eos = generation.get("eos_token_id")
        eos_ids = {eos} if isinstance(eos, int) else set(eos) if isinstance(eos, list) else set()
        if self._id_of(self.eos_token) is not None:
            eos_ids.add(self._id_of(self.eos_token))
        self.eos_ids: frozenset[int] = frozenset(i for i in eos_ids if isinstance(i, int) and not isinstance(i, bool))
        # transformers prepends BOS itself for Llama-style configs whose tokenizer.json does not
        self._add_bos = config.get("add_bos_token") is True and self.bos_id is not None
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) and template.strip() else None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, as the tokenizer adds them (BOS for most decoders).
        A prompt made by `chat_prompt` holds its special tokens as text: encode it without."""
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens (BOS, EOS, padding) left out."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def stream(self) -> TextStream:
        return TextStream(self)

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text of a conversation (`[{"role": "user", "content": "..."}, ...]`) ending where the
        assistant's reply begins: the tokenizer's chat template (rendered as transformers does, in a jinja2
        sandbox, add_generation_prompt=True) where it has one, else plain turns, "user: ...\\nassistant: "."""
        if self.chat_template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        import jinja2

        try:
            template = _template_environment().from_string(self.chat_template)
        except jinja2.TemplateError as error:
            raise ValueError(f"the tokenizer's chat template is not valid jinja2: {error}") from None
        specials = {key: _token_text(value) for key, value in self.config.items()
                    if key.endswith("_token") and _token_text(value) is not None}
        return template.render(**specials, messages=messages, add_generation_prompt=True)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The token ids of `chat_prompt(messages)`: a template writes the special tokens it wants, plain turns
        get the tokenizer's own; either way a BOS (where the tokenizer has one) starts the sequence."""
        ids = self.encode(self.chat_prompt(messages), add_special_tokens=self.chat_template is None)
        return ids if self.bos_id is None or ids[:1] == [self.bos_id] else [self.bos_id, *ids]


def _template_environment():
    """The jinja2 environment chat templates are written for: transformers' (`apply_chat_template`): a sandbox
    with trim_blocks and lstrip_blocks, the loop-control extension (`{% break %}`, `{% continue %}`), a `tojson`
    that keeps non-ASCII text and takes json.dumps' options, `strftime_now`, `raise_exception`, and the
    `{% generation %}` tag (transformers marks the assistant's tokens with it; here it renders its body)."""
    import json as json_module
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):  # templates call it to refuse a conversation (say, roles out of order)
        raise ValueError(f"the chat template refuses this conversation: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json_module.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                 sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, "jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    return value if isinstance(value, dict) else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config writes it: its text, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(artifact_dir) -> TextTokenizer | None:
    """The artifact's tokenizer, None when it has none. Its files are checked against the manifest's sha256
    (only theirs: the weights' are the engine's to check)."""
    directory = Path(artifact_dir)
    manifest = load_manifest(directory, check_hashes=False)
    listed = {relative: digest for relative, digest in manifest.files.items()
              if relative.startswith(TOKENIZER_DIR + "/")}
    if not listed:
        return None
    if f"{TOKENIZER_DIR}/{TOKENIZER_FILE}" not in listed:
        raise ArtifactError(f"manifest.json is damaged: it lists {', '.join(sorted(listed))} but no "
                            f"{TOKENIZER_DIR}/{TOKENIZER_FILE}; rebuild the artifact")
    for relative, digest in listed.items():
        if sha256(directory / relative) != digest:
            raise ArtifactError(f"artifact file {relative} is damaged (sha256 mismatch): rebuild the artifact")
    try:
        return TextTokenizer(directory / TOKENIZER_DIR)
    except ValueError as error:
        raise ArtifactError(f"the artifact's tokenizer cannot be read: {error}") from None
