"""Prompt tokenisation, the way vLLM does it, and kvplane's default tiny tokenizer.

Engines and the router must turn a request into the same token ids, or the router's
block keys never match the engine's cache. vLLM's rules, followed here:
- `/v1/completions`: a string prompt is encoded with special tokens added (BOS where the
  tokenizer defines one); a prompt given as token ids is taken as it is.
- `/v1/chat/completions`: the tokenizer's chat template renders the messages (with the
  generation prompt by default), and the result is encoded without adding special tokens
  again (the template writes them).

No model or tokenizer can be downloaded where kvplane is tested, so kvplane ships a small
byte-level BPE tokenizer with a chat template in Hugging Face format
(`kvplane/core/tokenizer_data/`), built deterministically by `build_default_tokenizer`. Any
local Hugging Face tokenizer directory works in its place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from kvplane.core.tokenizer_pieces import PieceTokenizer

DEFAULT_TOKENIZER_DIR = Path(__file__).parent / "tokenizer_data"

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "tokenize", "add_generation_prompt", "return_dict", "conversation"}
)
_VOCAB_SIZE = 512
_BOS, _EOS, _PAD = "<s>", "</s>", "<pad>"
_ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Training text: fixed, so that the merges (and every token id) are the same on every
# machine. Its content only shapes which merges exist; any English text would do.
_TRAINING_TEXT = """\
The cache remembers what the model has already read, so a request that starts the same
way as an earlier one can skip the work of reading that part again. A router that knows
which replica holds which prefix sends each request where most of it is already cached.
You are a helpful assistant. Answer the question below in one short paragraph.
What is the capital of France? Paris is the capital and the largest city of France.
Summarise the following document for an engineer who has five minutes to read it.
Translate this sentence into German, then explain the grammar of the translation.
Write a Python function that returns the longest common prefix of two lists of tokens.
def longest_common_prefix(left, right):
    size = 0
    for a, b in zip(left, right):
        if a != b:
            break
        size += 1
    return size
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > .
Each block of sixteen tokens gets a key that depends on every token before it.
When memory runs out, the engine evicts the blocks that were freed longest ago first.
"""


MIN_COUNT_CHUNK_CHARS = 16 * 1024
CUT_SLACK_TOKENS = 16
"""Tokens a cut between two chunks may add to their counts (a word, or an added token,
split in two); counts_past() takes this much off per cut, so that it never finds a
prompt longer than it is."""


class PromptTokenizer:
    """A Hugging Face tokenizer with vLLM's rules for turning requests into token ids."""

    def __init__(self, path: Path) -> None:
        _quiet_transformers()
        _tokenise_in_the_calling_thread()
        from transformers import AutoTokenizer

        if not path.is_dir():
            raise FileNotFoundError(f"no tokenizer directory at {path}")
        self.path = path
        self._tokenizer: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        # Piecewise tokenisation where it is exact for this tokenizer; else the reason.
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        pieces = PieceTokenizer.of(backend) if backend is not None else "it is not a fast one"
        self.pieces: PieceTokenizer | None = pieces if isinstance(pieces, PieceTokenizer) else None
        self.no_pieces_reason = pieces if isinstance(pieces, str) else None

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def counts_past(self, text: str, limit: int) -> int | None:
        """A lower bound on the tokens of `text`, when it is over `limit`; else None.

        Tokenises the text a chunk at a time (chunks end at whitespace where they can)
        and stops as soon as the count is past the limit, so that a prompt megabytes
        long costs about the limit's worth of tokenising, not its own."""
        chunk_chars = max(limit, MIN_COUNT_CHUNK_CHARS)
        counted = cuts = start = 0
        while start < len(text):
            end = min(start + chunk_chars, len(text))
            if end < len(text):
                space = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
                end = space if space > start + chunk_chars // 2 else end
            counted += len(self.encode(text[start:end], add_special_tokens=False))
            at_least = counted - cuts * CUT_SLACK_TOKENS
            if at_least > limit:
                return at_least
            cuts += 1
            start = end
        return None

    def completion_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a `/v1/completions` prompt."""
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a `/v1/chat/completions` request's messages.

        Raises ValueError when the tokenizer has no chat template or the template fails.
        """
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The text the chat template makes of the messages; it is encoded without adding
        special tokens (the template writes them).

        Raises ValueError when the tokenizer has no chat template or the template fails.
        """
        if not self._tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        overridden = _RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if overridden:
            # A request must not swap the template (code that runs here) or the call's mode.
            raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(overridden))}")
        try:
            text = self._tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **dict(template_kwargs or {}),
            )
        except Exception as error:  # jinja2 errors, raise_exception() in templates
            raise ValueError(f"the chat template failed: {type(error).__name__}") from error
        return str(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def plain_token_ids(self) -> list[int]:
        """Ids of ordinary tokens that decode to printable ASCII on their own, so that
        generated text can be streamed token by token without broken characters."""
        special = set(self._tokenizer.all_special_ids)
        plain = []
        for token_id in range(len(self._tokenizer)):
            if token_id in special:
                continue
            text = self._tokenizer.decode([token_id])
            if text and text.isascii() and text.isprintable():
                plain.append(token_id)
        return plain


@cache
def load_tokenizer(path: Path | None = None) -> PromptTokenizer:
    """The tokenizer in `path` (a Hugging Face tokenizer directory), or the default one.
    Loaded once per path per process."""
    return PromptTokenizer(path or DEFAULT_TOKENIZER_DIR)


def build_default_tokenizer(directory: Path) -> None:
    """Train kvplane's default tokenizer and save it in Hugging Face format.

    Deterministic: the same files on every machine (tests/core/test_tokenizer.py rebuilds it
    and compares with the shipped copy).
    """
    _quiet_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=[_PAD, _BOS, _EOS, *_ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    # Like Llama's: completions prompts start with BOS (the chat template writes its own).
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{_BOS} $A", special_tokens=[(_BOS, bpe.token_to_id(_BOS))]
    )
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        bos_token=_BOS,
        eos_token=_EOS,
        pad_token=_PAD,
        additional_special_tokens=list(_ROLE_TOKENS),
        chat_template=_CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )
    directory.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(directory))
    _normalise_json_files(directory)


def _normalise_json_files(directory: Path) -> None:
    """Rewrite the saved JSON with sorted keys, so that the files compare byte for byte
    whatever order a library version happens to write them in."""
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _quiet_transformers() -> None:
    # transformers warns at import that PyTorch is absent; kvplane never needs a model.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _tokenise_in_the_calling_thread() -> None:
    # The tokenizers library hands every batch call, one text included, to its own
    # thread pool and waits; the pool's threads then spin before they sleep. In a router
    # under load that was two busy threads with about 750 context switches and 5 ms of
    # CPU a second, for no parallelism: a prompt's new text is one piece or a few short
    # ones, and a long one is already tokenised in a worker thread off the event loop.
    # The library reads this variable at each call; an operator's own value stands.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
