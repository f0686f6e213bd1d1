"""A request's prompt as token ids, as the engine will see them: each served model's
tokenizer, and caches that spare work the router has already done.

Tokenising is the most expensive step of routing a long prompt (about 0.5 µs a token
with kvplane's tiny tokenizer: 4 ms for 8k tokens, where the decision takes well under
1 ms). Two caches, each keyed with the request's cache scope (a hit is faster: across
scopes that would tell one tenant that another sent the same text):
- whole prompts, by a 128-bit hash of exactly what tokenisation reads (the model, the
  prompt or the messages and the template's arguments): a retry, a repeated evaluation
  prompt or a client's fan-out costs the hash;
- pieces of prompts: the text between two added tokens (a system prompt, a tool schema,
  an earlier turn of the conversation) is tokenised once and its ids reused wherever it
  comes again, so that a prompt that shares most of its text with earlier ones costs the
  new text only. A long such text missed whole is cut between words about every 512
  characters (a document, a prompt of the completions API that repeats the start of an
  earlier one), and kept both whole and cut. `kvplane.core.tokenizer_pieces` says
  why this equals tokenising the whole text and which tokenizers it refuses; the first
  uses of each tokenizer and a sample after them are compared with whole tokenisation
  all the same, and a difference turns pieces off for that tokenizer.

A prompt whose start the piece cache holds and whose new text at its end is short
(`PromptStart`) can be routed on the start alone: blocks past it are held only where
all of the start is, and `start()` leaves the rest to be tokenised once the request
is on its way (router/proxy/service.py, `route_prompt`).
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import msgspec
import xxhash

from kvplane.core.config import ProxySettings
from kvplane.core.tokenizer import PromptTokenizer, load_tokenizer
from kvplane.core.tokenizer_pieces import Piece, PieceTokenizer
from router.lifecycle.bodies import Endpoint, ParsedRequest, PromptText, prompt_input

logger = logging.getLogger(__name__)

OFF_LOOP_CHARS = 8 * 1024
"""Text to tokenise (what the caches do not hold) longer than this is tokenised in a
worker thread, so that one long new prompt (milliseconds of work) does not hold up
every other request's bytes; a long prompt made of pieces seen before is assembled on
the event loop."""

MIN_CACHED_PIECE_CHARS = 64
"""Shorter pieces (a newline between two role tokens) are tokenised every time: cheaper
than a cache entry."""
MAX_PIECES = 1024
"""A prompt cut into more pieces than this is tokenised whole: a chat makes a few pieces
a message, and a body stuffed with added tokens would otherwise cost a step of Python
for each of them where the tokenizer spends nanoseconds."""
COUNTED_FIRST_CHARS_PER_TOKEN = 4
"""A prompt longer than this many characters per token of its limit is counted a chunk
at a time (PromptTokenizer.counts_past) before it is tokenised: past the limit, it is
refused having cost about the limit's worth of tokenising. Text averages 3-5 characters
a token, so a prompt within its limit rarely pays for the count."""

DEFERRED_REST_SHARE = 4
"""New text at a prompt's end may be left to tokenise after the request is sent when it
is at most this fraction (1/4) of the prompt's text, and no longer than OFF_LOOP_CHARS:
a conversation's next turn, a question after a shared document. A router replica that
sees a conversation mid-way has its history to tokenise, the larger part: that is
tokenised first, as is a fresh prompt."""

CHECKED_FIRST_USES = 8
CHECK_ONE_IN = 1024
"""Piecewise results compared with whole tokenisation: every one of a tokenizer's first
uses, then one in this many."""

_encoder = msgspec.json.Encoder()
_A = TypeVar("_A")
_R = TypeVar("_R")


class Tokenizers:
    """Each served model's tokenizer, loaded on first use."""

    def __init__(self, settings: ProxySettings) -> None:
        self._settings = settings

    def for_model(self, model: str) -> PromptTokenizer:
        path: Path | None = self._settings.tokenizer_dirs.get(model, self._settings.tokenizer_dir)
        return load_tokenizer(path)

    def preload(self) -> None:
        """Load every configured tokenizer now: a missing directory fails the start,
        not a request, and the first request does not wait seconds for the load."""
        paths = {self._settings.tokenizer_dir, *self._settings.tokenizer_dirs.values()}
        for path in paths:  # all checked before the tokenizer library's slow import
            if path is not None and not path.is_dir():
                raise FileNotFoundError(f"no tokenizer directory at {path}")
        for path in paths:
            tokenizer = load_tokenizer(path)
            if tokenizer.no_pieces_reason is not None:
                logger.info(
                    "prompts for the tokenizer in %s are tokenised whole: %s",
                    tokenizer.path,
                    tokenizer.no_pieces_reason,
                )
            elif tokenizer.pieces and tokenizer.pieces.no_cuts_between_words_reason:
                logger.info(
                    "long texts for the tokenizer in %s are cut only at added tokens: %s",
                    tokenizer.path,
                    tokenizer.pieces.no_cuts_between_words_reason,
                )


class TokenCache:
    """Least recently used token ids, bounded by their total count; safe to share
    between the event loop and the threads that tokenise long prompts."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, array.array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> array.array[int] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: bytes, token_ids: Sequence[int]) -> array.array[int]:
        entry = array.array("I", token_ids)
        if len(entry) > self.max_tokens:
            return entry
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self.tokens -= len(previous)
            self._entries[key] = entry
            self.tokens += len(entry)
            while self.tokens > self.max_tokens:
                _, evicted = self._entries.popitem(last=False)
                self.tokens -= len(evicted)
        return entry


class PromptLength(NamedTuple):
    """How long a model's prompts may be: over `limit` tokens a prompt is refused;
    within it, it goes only to workers whose max_model_len takes it, if `per_worker`
    (the router counts prompts as the model's engines do)."""

    limit: int
    per_worker: bool


class PromptTooLong(Exception):
    """A prompt with more tokens than its model takes: refused before it is routed."""

    def __init__(self, tokens: int, limit: int, *, at_least: bool) -> None:
        self.tokens = tokens
        self.limit = limit
        super().__init__(
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{'at least ' if at_least else ''}{tokens} tokens."
        )


@dataclass(frozen=True, slots=True)
class PromptStart:
    """A prompt's token ids whole, or the start of them that the caches held, with its
    new text left to tokenise (`rest`)."""

    ids: Sequence[int]
    estimated_tokens: int  # the whole prompt's count: len(ids), or with the rest estimated
    most_tokens: int  # no more than this in all: len(ids), or with the rest's bytes
    rest: Callable[[], Sequence[int]] | None = None  # the whole prompt's ids

    @classmethod
    def whole(cls, ids: Sequence[int]) -> PromptStart:
        return cls(ids, len(ids), len(ids))

    def completed(self) -> PromptStart:
        """The whole prompt, its rest tokenised now if need be."""
        return self if self.rest is None else PromptStart.whole(self.rest())


@dataclass(slots=True)
class _PiecePlan:
    """A prompt cut into units (pieces, and segments of long runs missed whole), with
    the ids the caches held for each; None where a unit is still to encode."""

    units: list[Piece]
    found: list[Sequence[int] | None]
    keys: dict[int, bytes]  # of the units that are cached
    cut_runs: list[tuple[bytes, int, int]]  # a run missed whole: its key, its units

    def first_new(self) -> int | None:
        """The first unit worth a cache entry that the cache did not hold."""
        for at, unit_ids in enumerate(self.found):
            if unit_ids is None and len(self.units[at].text) >= MIN_CACHED_PIECE_CHARS:
                return at
        return None

    def missing(self, start: int, end: int) -> list[int]:
        return [at for at in range(start, end) if self.found[at] is None]


def _within(token_ids: Sequence[int], limit: int | None) -> Sequence[int]:
    if limit is not None and len(token_ids) > limit:
        raise PromptTooLong(len(token_ids), limit, at_least=False)
    return token_ids


@dataclass(frozen=True, slots=True)
class TokenisationStats:
    """What the caches saved since start, for the metrics."""

    prompt_hits: int
    prompt_misses: int
    piece_tokens_reused: int  # token ids taken from the piece cache
    piece_tokens_tokenised: int  # token ids of pieces tokenised anew
    cached_tokens: int  # held by both caches
    piecewise_checks: int
    piecewise_differences: int


def tokenisation_key(request: ParsedRequest, scope: str) -> bytes:
    """A hash of the cache scope and everything `prompt_input` reads."""
    body = request.body
    if request.endpoint is Endpoint.COMPLETIONS:
        read: list[object] = ["completions", scope, request.model, body.get("prompt")]
    else:
        read = [
            "chat",
            scope,
            request.model,
            body.get("messages"),
            body.get("add_generation_prompt", True),
            body.get("chat_template_kwargs"),
            body.get("tools"),
        ]
    return xxhash.xxh3_128_digest(_encoder.encode(read))


def piece_key(scope: str, piece: Piece) -> bytes:
    """A piece's cache key: its scope, its text and whether it starts the prompt (which
    some tokenizers encode differently)."""
    marker = b"\x01" if piece.starts_text else b"\x00"
    return xxhash.xxh3_128_digest(scope.encode() + b"\x00" + marker + piece.text.encode())


class PromptTokens:
    """prompt token ids with the model's tokenizer, cached, off the loop when long."""

    def __init__(self, settings: ProxySettings) -> None:
        self.tokenizers = Tokenizers(settings)
        self.cache = TokenCache(settings.token_cache_tokens)
        self.pieces = TokenCache(settings.token_cache_tokens)
        self._reused = 0
        self._tokenised = 0
        self._uses: dict[Path, int] = {}
        self._differences = 0
        self._checks = 0
        self._piecewise_off: set[Path] = set()

    def stats(self) -> TokenisationStats:
        return TokenisationStats(
            prompt_hits=self.cache.hits,
            prompt_misses=self.cache.misses,
            piece_tokens_reused=self._reused,
            piece_tokens_tokenised=self._tokenised,
            cached_tokens=self.cache.tokens + self.pieces.tokens,
            piecewise_checks=self._checks,
            piecewise_differences=self._differences,
        )

    async def of(
        self, request: ParsedRequest, scope: str, limit: int | None = None
    ) -> Sequence[int] | None:
        """The request's token ids; `scope` is the cache scope it is keyed in.

        Raises PromptTooLong for a prompt over `limit` tokens, found before the whole of
        a long prompt is tokenised."""
        start = await self.start(request, scope, limit, defer_rest=False)
        return None if start is None else start.ids

    async def start(
        self, request: ParsedRequest, scope: str, limit: int | None = None, *, defer_rest: bool
    ) -> PromptStart | None:
        """As of(); with `defer_rest`, a prompt whose start the caches hold and whose
        new text at the end is short (DEFERRED_REST_SHARE) comes as its start, with the
        rest to tokenise later (when that cannot make it longer than `limit`)."""
        try:
            key = tokenisation_key(request, scope)
        except (msgspec.EncodeError, TypeError, ValueError):  # not JSON-encodable: no cache
            key = None
        if key is not None:
            cached = self.cache.get(key)
            if cached is not None:
                return PromptStart.whole(_within(cached, limit))
        tokenizer = self.tokenizers.for_model(request.model)
        tokenised = await self._tokenise(request, tokenizer, scope, limit, defer_rest)
        if tokenised is None:
            return None
        if isinstance(tokenised, PromptStart):
            if key is None or tokenised.rest is None:
                return tokenised
            kept = functools.partial(self._kept, key, tokenised.rest)
            return dataclasses.replace(tokenised, rest=kept)
        _within(tokenised, limit)
        return PromptStart.whole(tokenised if key is None else self.cache.put(key, tokenised))

    def _kept(self, key: bytes, rest: Callable[[], Sequence[int]]) -> Sequence[int]:
        """A deferred rest's whole prompt, kept in the cache of whole prompts."""
        return self.cache.put(key, rest())

    async def _tokenise(
        self,
        request: ParsedRequest,
        tokenizer: PromptTokenizer,
        scope: str,
        limit: int | None,
        defer_rest: bool,
    ) -> Sequence[int] | PromptStart | None:
        prompt = prompt_input(request, tokenizer)
        if not isinstance(prompt, PromptText):
            return prompt
        if limit is not None and len(prompt.text) > limit * COUNTED_FIRST_CHARS_PER_TOKEN:
            past = await asyncio.to_thread(tokenizer.counts_past, prompt.text, limit)
            if past is not None:
                raise PromptTooLong(past, limit, at_least=True)
        pieces = tokenizer.pieces
        parts = (
            None
            if pieces is None
            or tokenizer.path in self._piecewise_off
            or (prompt.add_special_tokens and pieces.wrap is None)
            else pieces.split(prompt.text)
        )
        if pieces is None or parts is None or len(parts) > MAX_PIECES:
            return await _off_loop_if(len(prompt.text), prompt.whole_tokens, tokenizer)
        plan = self._plan(pieces, parts, scope)
        uses = self._uses[tokenizer.path] = self._uses.get(tokenizer.path, 0) + 1
        checked = uses <= CHECKED_FIRST_USES or uses % CHECK_ONE_IN == 0
        if defer_rest and not checked:
            started = self._started(
                pieces, plan, prompt.add_special_tokens, len(prompt.text), limit
            )
            if started is not None:
                return started
        missing = plan.missing(0, len(plan.units))
        new = [plan.units[at] for at in missing]
        encoded = await _off_loop_if(sum(len(unit.text) for unit in new), pieces.encode, new)
        self._store(plan, missing, encoded)
        token_ids = self._assembled(pieces, plan, prompt.add_special_tokens)
        if checked:
            self._checks += 1
            whole = await _off_loop_if(len(prompt.text), prompt.whole_tokens, tokenizer)
            if array.array("I", whole) != token_ids:
                self._differences += 1
                self._piecewise_off.add(tokenizer.path)
                logger.warning(
                    "piecewise tokenisation differed from whole tokenisation for the "
                    "tokenizer in %s (model %s); prompts are tokenised whole from now on",
                    tokenizer.path,
                    request.model,
                )
                return whole
        return token_ids

    def _started(
        self,
        pieces: PieceTokenizer,
        plan: _PiecePlan,
        add_special_tokens: bool,
        prompt_chars: int,
        limit: int | None,
    ) -> PromptStart | None:
        """The prompt's start with its new text left for later, or None when the new
        text is not a short end (DEFERRED_REST_SHARE) or could take it past `limit`."""
        cut = plan.first_new()
        if cut is None:
            return None
        rest_units = plan.units[cut:]
        rest_chars = sum(len(unit.text) for unit in rest_units)
        if rest_chars * DEFERRED_REST_SHARE > prompt_chars or rest_chars > OFF_LOOP_CHARS:
            return None
        self._encode(pieces, plan, plan.missing(0, cut))  # short pieces, never kept
        before, after = pieces.wrap if add_special_tokens and pieces.wrap else ([], [])
        ids = _joined([before, *plan.found[:cut]])
        # A token is at least a byte of text, or an added token.
        most = len(ids) + len(after)
        most += sum(
            1 if unit.token_id is not None else len(unit.text.encode()) for unit in rest_units
        )
        if limit is not None and most > limit:
            return None
        known_chars = prompt_chars - rest_chars
        estimated = len(ids) + len(after) + round(rest_chars * len(ids) / max(1, known_chars))
        finish = functools.partial(self._rest, pieces, plan, cut, add_special_tokens)
        return PromptStart(ids, min(estimated, most), most, finish)

    def _rest(
        self,
        pieces: PieceTokenizer,
        plan: _PiecePlan,
        cut: int,
        add_special_tokens: bool,
    ) -> array.array[int]:
        """The whole prompt's ids, its rest tokenised (new pieces kept in their cache)."""
        self._encode(pieces, plan, plan.missing(cut, len(plan.units)))
        return self._assembled(pieces, plan, add_special_tokens)

    def _plan(self, pieces: PieceTokenizer, parts: list[Piece], scope: str) -> _PiecePlan:
        units: list[Piece] = []  # what is looked up and encoded
        found: list[Sequence[int] | None] = []
        keys: dict[int, bytes] = {}  # of the units that are cached
        cut_runs: list[tuple[bytes, int, int]] = []  # a run missed whole: its key, its units
        for piece in parts:
            if piece.token_id is not None:
                units.append(piece)
                found.append((piece.token_id,))
                continue
            if len(piece.text) < MIN_CACHED_PIECE_CHARS:
                units.append(piece)
                found.append(None)
                continue
            # The run whole first (a system prompt, a document seen before: one lookup);
            # missed, the segments it is cut into between words (a text that repeats the
            # start of an earlier one), and once tokenised it is kept both ways.
            key = piece_key(scope, piece)
            cached = self._reuse(key)
            segments = [piece] if cached is not None else pieces.segments(piece)
            if len(segments) == 1:
                keys[len(units)] = key
                units.append(piece)
                found.append(cached)
                continue
            cut_runs.append((key, len(units), len(units) + len(segments)))
            for segment in segments:
                if len(segment.text) >= MIN_CACHED_PIECE_CHARS:
                    keys[len(units)] = piece_key(scope, segment)
                    found.append(self._reuse(keys[len(units)]))
                else:
                    found.append(None)
                units.append(segment)
        return _PiecePlan(units, found, keys, cut_runs)

    def _encode(self, pieces: PieceTokenizer, plan: _PiecePlan, units: list[int]) -> None:
        """The units encoded here, on the event loop (short text only)."""
        if units:
            self._store(plan, units, pieces.encode([plan.units[at] for at in units]))

    def _store(self, plan: _PiecePlan, units: list[int], encoded: list[list[int]]) -> None:
        """The units' new ids in the plan, and in the piece cache where they are kept."""
        for at, new in zip(units, encoded, strict=True):
            self._tokenised += len(new)
            plan.found[at] = self.pieces.put(plan.keys[at], new) if at in plan.keys else new

    def _assembled(
        self, pieces: PieceTokenizer, plan: _PiecePlan, add_special_tokens: bool
    ) -> array.array[int]:
        """The prompt's ids, every unit encoded; the runs missed whole kept whole too."""
        for key, first, end in plan.cut_runs:
            self.pieces.put(key, _joined(plan.found[first:end]))
        before, after = pieces.wrap if add_special_tokens and pieces.wrap else ([], [])
        return _joined([before, *plan.found, after])

    def _reuse(self, key: bytes) -> Sequence[int] | None:
        cached = self.pieces.get(key)
        if cached is not None:
            self._reused += len(cached)
        return cached


def _joined(parts: Sequence[Sequence[int] | None]) -> array.array[int]:
    """The parts' ids in one array, as the caches hold them: arrays are copied as bytes,
    where a list would make an int object of each id (0.7 ms for 32k tokens)."""
    token_ids = array.array("I")
    for part in parts:
        token_ids.extend(part or ())
    return token_ids


async def _off_loop_if(text_chars: int, work: Callable[[_A], _R], argument: _A) -> _R:
    """`work(argument)`, in a worker thread when it tokenises more than OFF_LOOP_CHARS of
    text: a thread hop costs more than tokenising a short text, and a long one would
    hold up every other request's bytes."""
    if text_chars > OFF_LOOP_CHARS:
        return await asyncio.to_thread(work, argument)
    return work(argument)
