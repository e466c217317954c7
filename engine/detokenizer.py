"""Incremental detokenization and stop strings, per sequence.

Text is decoded over a short window of recent tokens; a piece ending in U+FFFD (a UTF-8
character whose bytes are split over tokens) is held back until the next token completes it.
Bytes that can never complete (a run of stray continuation bytes, which random or broken
models emit) are released as U+FFFD once a later byte shows they are final, where the
tokenizer decodes bytes one error at a time; a byte-fallback decoder, which may turn a whole
run of byte tokens from U+FFFD into text at its last byte, keeps holding them (there, a run
that turns invalid after some of its characters were shown reads as all U+FFFD in a decode
of the whole output, while the stream keeps what it showed: broken output only).
Text that could be the beginning of a stop string is also held back, so a stop string spread
over several tokens is never half-emitted. Stop strings are found by `StopMatcher`, an
Aho-Corasick automaton fed each new character once: a token costs time linear in its text,
whatever the number and length of the stops.
"""

from __future__ import annotations

import functools


def replacement_is_final(tokenizer) -> bool:
    """Whether U+FFFD followed by more text stays U+FFFD whatever comes next: true for fast
    tokenizers decoding bytes as UTF-8 with replacement (byte-level BPE: GPT-2, Llama 3, Qwen,
    SmolLM2); false with a ByteFallback decoder (SentencePiece models) or a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return backend is not None  # no decoder: tokens are joined as they are
    try:
        state = decoder.__getstate__()  # the decoder (and any it chains) as JSON bytes
    except Exception:
        return False
    return b'"ByteFallback"' not in state


class StopAutomaton:
    """The Aho-Corasick automaton of a set of stop strings (immutable; shared by a request's samples).

    A node is a prefix of some stop; `depth[node]` is its length, `fail[node]` the node of its
    longest proper suffix that is also a prefix of a stop, `match[node]` the length of the
    longest stop that is a suffix of it (0 = none). Built in time linear in the stops' total length.
    """

    __slots__ = ("goto", "fail", "depth", "match", "longest")

    def __init__(self, stops: tuple[str, ...]):
        self.goto: dict[tuple[int, str], int] = {}  # (node, character) -> child node (trie edges only)
        self.fail = [0]
        self.depth = [0]
        self.match = [0]
        self.longest = max((len(s) for s in stops), default=0)
        for stop in stops:
            node = 0
            for ch in stop:
                child = self.goto.get((node, ch))
                if child is None:
                    child = len(self.depth)
                    self.goto[(node, ch)] = child
                    self.fail.append(0)
                    self.depth.append(self.depth[node] + 1)
                    self.match.append(0)
                node = child
            self.match[node] = len(stop)
        children: dict[int, list[tuple[str, int]]] = {}
        for (parent, ch), child in self.goto.items():
            children.setdefault(parent, []).append((ch, child))
        frontier = [child for _, child in children.get(0, ())]  # depth 1: fail to the root
        while frontier:  # breadth first: a node's fail link is set before its children need it
            next_frontier = []
            for node in frontier:
                for ch, child in children.get(node, ()):
                    self.fail[child] = self.step(self.fail[node], ch)
                    if not self.match[child]:
                        self.match[child] = self.match[self.fail[child]]
                    next_frontier.append(child)
            frontier = next_frontier

    def step(self, node: int, ch: str) -> int:
        """The node after reading `ch` at `node` (amortized O(1) over a text)."""
        goto = self.goto
        while True:
            child = goto.get((node, ch))
            if child is not None:
                return child
            if node == 0:
                return 0
            node = self.fail[node]


@functools.lru_cache(maxsize=32)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """One automaton per distinct set of stops (the n samples of a request share it)."""
    return StopAutomaton(stops)


class StopMatcher:
    """Streams text through a `StopAutomaton`: finds the earliest stop string and says how much
    of the text's tail could still begin one."""

    __slots__ = ("automaton", "node", "scanned")

    def __init__(self, stops: tuple[str, ...]):
        self.automaton = stop_automaton(tuple(stops))
        self.node = 0  # the longest tail of the text read so far that is a prefix of a stop
        self.scanned = 0  # characters of the text read so far

    def feed(self, text: str, start: int) -> int | None:
        """Reads `text[start:]` (the text given before is `text[:start]`); returns where the
        earliest stop string that ends in the new part begins, or None."""
        automaton = self.automaton
        step, match, longest = automaton.step, automaton.match, automaton.longest
        node = self.node
        best: int | None = None
        for position in range(start, len(text)):
            if best is not None and position + 1 - longest >= best:
                break  # no stop ending here or later can begin before `best`
            node = step(node, text[position])
            length = match[node]
            if length:
                begin = position + 1 - length  # the longest stop ending here begins first
                if best is None or begin < best:
                    best = begin
        self.node = node
        self.scanned = len(text)
        return best

    @property
    def partial(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return self.automaton.depth[self.node]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, release_final_replacements: bool | None = None):
        self.tokenizer = tokenizer
        if release_final_replacements is None:
            release_final_replacements = replacement_is_final(tokenizer)
        self.release_final_replacements = release_final_replacements
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # output tokens only
        self.prefix_offset = 0  # window start: decoding restarts here for context
        self.read_offset = 0  # tokens before this are already emitted as text
        self.text = ""  # all text decoded so far (stop string excluded once found)
        self.emitted = 0  # characters of `text` handed out
        self.stop = stop
        self.stop_matcher = StopMatcher(stop) if stop else None
        self.stopped = False  # a stop string was found; `text` ends right before it

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Add one token; returns the new text that is safe to show (maybe "")."""
        self.token_ids.append(token_id)
        window_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) > len(window_text) and not new_text.endswith("\ufffd"):
            self._commit(new_text[len(window_text):], len(self.token_ids))
        elif self.release_final_replacements and new_text.endswith("\ufffd"):
            # the longest run of held tokens whose text the later ones only extended: final
            for cut in range(len(self.token_ids) - 1, self.read_offset, -1):
                cut_text = self._decode(self.token_ids[self.prefix_offset:cut])
                if len(window_text) < len(cut_text) < len(new_text) and new_text.startswith(cut_text):
                    self._commit(cut_text[len(window_text):], cut)
                    break
        return self._release(final=False)

    def _commit(self, text: str, read_offset: int) -> None:
        self.text += text
        self.prefix_offset = self.read_offset
        self.read_offset = read_offset

    def prime(self, token_ids: list[int]) -> None:
        """Start after output that was already shown (a resumed stream): what these tokens
        released counts as emitted, and what they held back (an incomplete character, a tail that
        could begin a stop string) is still held, as it was when the stream was cut. So the
        continuation's text is the uncut stream's text on every backend: an aborted sequence
        does not flush (see `EngineCore._finish`), so a cut never showed what was held."""
        for token_id in token_ids:
            self.add(token_id)

    def flush(self) -> str:
        """At the end: whatever was held back (never a broken stop string: it is removed)."""
        if not self.stopped and self.read_offset < len(self.token_ids):
            window_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset:])
            self.text += new_text[len(window_text):]
            self.read_offset = len(self.token_ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        matcher = self.stop_matcher
        if matcher is not None and not self.stopped:
            hit = matcher.feed(self.text, matcher.scanned)
            if hit is not None:
                self.text = self.text[:hit]
                self.stopped = True
        end = len(self.text)
        if matcher is not None and not self.stopped and not final:
            end -= matcher.partial
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta
