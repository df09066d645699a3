"""Schema-constrained decoding: an mlx-lm logits processor driven by llguidance.

llguidance compiles a JSON schema into a grammar and, at each step, gives the set of
tokens that can continue a valid document as a bitmask over the vocabulary, for any
Hugging Face tokenizer. The processor masks every other token to -inf before the
sampler sees the logits, so whatever the weights (a random test model included),
the reply parses and validates; once the document is complete, only the end-of-text
token is allowed. Why llguidance and not xgrammar or outlines-core: docs/llm-plugin.md.

Output is compact JSON (no free whitespace): a model cannot pad the reply with
newlines forever, and the text is what `json.loads` reads.
"""

from __future__ import annotations

import json
import weakref
from typing import Optional

from ..errors import one_line

CLOSING_MIN_TOKENS = 32
COMPILE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class SchemaError(ValueError):
    """The schema cannot be compiled into a grammar; the message is one line."""


def schema_grammar(schema) -> str:
    """The llguidance grammar of a JSON schema (dict or JSON text); SchemaError if it
    cannot be compiled."""
    import llguidance

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SchemaError(f"the schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    return checked_grammar(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPILE_OPTIONS))


def text_grammar(syntax: str, definition: str) -> str:
    """The llguidance grammar of a Lark or regex definition (a custom tool's input);
    SchemaError if it cannot be compiled."""
    import llguidance

    if syntax not in ("lark", "regex"):
        raise SchemaError(f"a {syntax!r} grammar: the syntaxes are lark and regex")
    return checked_grammar(lambda: llguidance.grammar_from(syntax, definition), f"the {syntax} grammar")


def checked_grammar(make, what: str = "the schema") -> str:
    """The grammar `make()` builds, validated; SchemaError in one line if it is not valid."""
    import llguidance

    try:
        grammar = make()
    except ValueError as exc:
        raise SchemaError(f"{what} cannot be compiled: {_short(exc)}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SchemaError(f"{what} cannot be compiled: {_short(messages[0])}")
    return grammar


_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ll_tokenizer(hf_tokenizer, n_vocab: int, eos_ids):
    """llguidance's view of a Hugging Face tokenizer (built once per tokenizer and
    vocabulary size: it takes about a second on a large vocabulary)."""
    import llguidance.hf

    key = (n_vocab, tuple(eos_ids))
    cached = _tokenizers.setdefault(hf_tokenizer, {})
    if key not in cached:
        cached[key] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=list(eos_ids))
    return cached[key]


CUT_SHORT = ("Warning: max_tokens ended the reply before the --schema document was complete, "
             "so it does not validate; raise -o max_tokens")


def cut_short_notice(stats: dict) -> Optional[str]:
    """The one-line warning for a reply whose schema document was left open."""
    return CUT_SHORT if stats.get("schema_closed") is False else None


def new_matcher(grammar: str, tokenizer, n_vocab: int):
    """An llguidance matcher of `grammar` over mlx-lm's tokenizer wrapper's vocabulary."""
    import llguidance

    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    matcher = llguidance.LLMatcher(ll_tokenizer(hf, n_vocab, eos), grammar, log_level=0)
    _check(matcher)
    return matcher


def _check(matcher) -> None:
    if matcher.is_error():
        raise SchemaError(f"constrained decoding failed: {_short(matcher.get_error())}")


def allowed_tokens(matcher, n_vocab: int):
    """The tokens `matcher` allows next, as a numpy bool mask."""
    import numpy as np

    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:n_vocab].astype(bool)


class GrammarLead:
    """A grammar the next part of a reply follows until it could end there, after which
    anything may (processors.Continuation: what follows a reasoning closed by its budget).
    A function of the tokens it is shown: its matcher is rolled back to what they share
    with those it was fed, then fed the rest."""

    def __init__(self, grammar: str, tokenizer):
        self.grammar, self.tokenizer = grammar, tokenizer
        self.matcher, self.fed = None, []

    def allowed(self, written: list[int], n_vocab: int):
        import numpy as np

        if self.matcher is None:
            self.matcher = new_matcher(self.grammar, self.tokenizer, n_vocab)
        same = next((i for i, (a, b) in enumerate(zip(self.fed, written)) if a != b), min(len(self.fed), len(written)))
        if same < len(self.fed):
            self.matcher.rollback(len(self.fed) - same)
            del self.fed[same:]
        rest = written[same:]
        taken = self.matcher.try_consume_tokens(rest) if rest else 0
        self.fed += rest[:taken]
        if taken < len(rest):  # a token the grammar refuses (a draft a verify pass will not keep)
            return np.ones(n_vocab, dtype=bool)
        return None if self.matcher.is_accepting() else allowed_tokens(self.matcher, n_vocab)


class SchemaProcessor:
    """An mlx-lm logits processor: `processor(tokens, logits) -> logits`.

    mlx-lm calls it once per step with every token fed so far (the prompt tokens
    that were not reused from the cache, then one more per step). The first call
    marks where the reply starts; each later call feeds the matcher the tokens
    sampled since, then masks the logits. If the token history gets shorter (a
    speculative draft rejected), the matcher is rolled back.
    """

    def __init__(self, grammar: str, tokenizer):
        self.grammar = grammar
        self.tokenizer = tokenizer  # mlx-lm's TokenizerWrapper
        self.matcher = None
        self.start: Optional[int] = None
        self.consumed = 0  # reply tokens seen
        self.fed = 0  # reply tokens the matcher consumed
        self.budget: Optional[int] = None
        self._window: Optional[int] = None
        self._n_vocab = 0

    def _begin(self, n_vocab: int) -> None:
        self.matcher = new_matcher(self.grammar, self.tokenizer, n_vocab)

    def _check(self) -> None:
        _check(self.matcher)

    def __call__(self, tokens, logits):
        import mlx.core as mx
        import numpy as np

        n_vocab = self._n_vocab = logits.shape[-1]
        if self.matcher is None:
            self._begin(n_vocab)
            self.start = len(tokens)
        else:
            generated = len(tokens) - self.start
            if generated < self.consumed:
                self.matcher.rollback(max(0, self.fed - generated))
                self.consumed = self.fed = min(self.fed, generated)
            if generated > self.consumed:
                new = [int(t) for t in tokens[self.start + self.consumed:].tolist()]
                if not self.matcher.is_stopped():  # not the end-of-text token after the end
                    self.matcher.consume_tokens(new)
                    self.fed = generated
                    self._check()
                self.consumed = generated
        if self.matcher.is_stopped():
            allowed = np.zeros(n_vocab, dtype=bool)
            allowed[self.tokenizer.eos_token_id] = True
        else:
            allowed = allowed_tokens(self.matcher, n_vocab)
            if self.budget is not None and self.budget - self.consumed <= self.closing_window():
                allowed = self._closing(allowed, tokens)
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def closed(self, reply: list[int]) -> bool:
        """Whether the whole `reply` (its token ids) is a complete document; the matcher
        has not yet seen the last tokens sampled."""
        if self.matcher is None:
            return False
        matcher = self.matcher.deep_copy()
        rest = [int(t) for t in reply[self.fed:]]
        if rest and not matcher.is_stopped():
            matcher.consume_tokens(rest)
        return not matcher.is_error() and (matcher.is_stopped() or matcher.is_accepting())

    # -- finishing the document within the token budget --------------------------
    def limit_tokens(self, budget: int) -> None:
        """Told by the engine: the reply may have at most `budget` tokens."""
        self.budget = budget

    def closing_window(self) -> int:
        """Tokens before the budget runs out at which the processor starts closing:
        twice what the shortest document takes (found once, by a model-free rollout)."""
        if self._window is None:
            self._window = max(CLOSING_MIN_TOKENS, 2 * self._shortest_document())
        return self._window

    def _preferred(self, allowed, text: str, matcher):
        """The end of the reply when `matcher` may end there (a grammar that allows more,
        like one more tool call, is not taken up on it); else the allowed tokens that
        close what compact JSON `text` leaves open, or all."""
        import numpy as np

        eos = self.tokenizer.eos_token_id
        if matcher.is_accepting() and allowed[eos]:
            return np.arange(len(allowed)) == eos
        first = token_table(self.tokenizer, len(allowed))[0]
        for group in closers(text):
            preferred = allowed & np.isin(first, list(group))
            if preferred.any():
                return preferred
        return allowed

    def _closing(self, allowed, tokens):
        """Near the end of the budget, keep only the allowed tokens that close what is
        open (a string, a number, an array or object), when there are any: a model
        that would go on (a random one writes strings forever) still ends with a
        complete document. The grammar's mask stays the authority."""
        text = self.tokenizer.decode([int(t) for t in tokens[self.start:].tolist()])
        return self._preferred(allowed, text, self.matcher)

    def _shortest_document(self, limit: int = 4096) -> int:
        """Tokens a document takes from the current state when every step closes what
        it can and otherwise takes the longest allowed token."""
        import numpy as np

        matcher = self.matcher.deep_copy()
        n_vocab = self._n_vocab
        _, lengths, texts = token_table(self.tokenizer, n_vocab)
        text, steps = "", 0
        while not matcher.is_stopped() and steps < limit:
            allowed = self._preferred(allowed_tokens(matcher, n_vocab), text, matcher)
            choice = int(np.argmax(np.where(allowed, lengths, -1)))
            if not allowed[choice] or not matcher.consume_token(choice) or matcher.is_error():
                break
            text += texts[choice]
            steps += 1
        return steps


def closers(text: str) -> list[str]:
    """First characters of the tokens that close what the compact JSON `text` leaves
    open, most wanted first: the string's quote; a number's or a finished value's
    comma or bracket."""
    in_string = escaped = False
    last = ""
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        if not ch.isspace():
            last = ch
    if in_string:
        return [] if escaped else ['"']
    if last and (last.isdigit() or last in '"]}el'):  # a value just ended (true/false/null end in e/l)
        return ["]}", ","]
    return []


_token_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def token_table(tokenizer, n_vocab: int):
    """(first character, text length, text) of each token id, the first two as numpy
    arrays ("" and 0 for ids beyond the tokenizer's vocabulary)."""
    import numpy as np

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    table = _token_tables.get(hf)
    if table is None or len(table[0]) != n_vocab:
        size = len(hf)
        texts = [hf.decode([i]) if i < size else "" for i in range(n_vocab)]
        table = (np.array([t[:1] for t in texts], dtype="<U1"), np.array([len(t) for t in texts]), texts)
        _token_tables[hf] = table
    return table


def _short(value, limit: int = 200) -> str:
    """llguidance's message on one line, cut short (a regex error draws a caret diagram)."""
    text = one_line(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
