"""Generated tokens to text, as they come: incremental detokenization (each new token costs a
decode of a few tokens, not of the whole output) and stop strings.

:class:`TextStream` uses the tokenizers library's own incremental decoder (``DecodeStream``, in
Rust) where the tokenizer is a fast one. Otherwise it keeps two offsets into the tokens, as
vLLM's detokenizer does: the text of ``tokens[prefix:read]`` was already emitted; decoding
``tokens[prefix:]`` and taking what it adds gives the new text, held back while it ends in an
incomplete character (U+FFFD). Either way a multi-byte character is never split, and decoding
starts a few tokens into the prompt, so tokenizers that decide a token's leading space from its
neighbour decode the first generated token as they would inside the text.

Stop strings are found in the text, never emitted: text that could still be the start of a
stop string is held back until the next tokens say it is not.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple


def _decode_stream() -> Any:
    """tokenizers' incremental decoder (tokenizers >= 0.22), or ``None`` (older: the two-decode path)."""
    try:
        from tokenizers.decoders import DecodeStream as stream
    except ImportError:
        return None
    return stream


DecodeStream: Any = _decode_stream()

#: Prompt tokens decoded before the first generated one (context for its leading space).
CONTEXT_TOKENS = 5


class TextStream:
    """The text of one choice's tokens: :meth:`push` the tokens generated since the last call,
    get the text that may be sent now and whether a stop string ended the choice."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int], stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.tokens: List[int] = list(prompt[-CONTEXT_TOKENS:])
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if DecodeStream is not None and self._backend is not None:
            try:
                self._stream = DecodeStream(ids=list(self.tokens), skip_special_tokens=True)
            except TypeError:  # a DecodeStream that takes no context
                self._stream = None
        self.prefix = 0
        self.read = len(self.tokens)
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""  # decoded, not yet sent (a possible stop string's start)
        self.text = ""  # everything sent
        self.stopped = False

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def _new_text(self) -> str:
        before = self._decode(self.tokens[self.prefix:self.read])
        after = self._decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.tokens)
            return after[len(before):]
        return ""

    def push(self, new_tokens: Sequence[int], final: bool = False) -> str:
        """Takes the tokens generated since the last call; returns the text that can be sent now
        (all of it when ``final``). After a stop string, :attr:`stopped` is set and nothing more
        is taken."""
        if self.stopped:
            return ""
        for token in new_tokens:
            if self._stream is not None:
                self.pending += self._stream.step(self._backend, token) or ""
            else:
                self.tokens.append(token)
                self.pending += self._new_text()
            if self.stops:
                cut = _first_stop(self.pending, self.stops)
                if cut is not None:
                    self.stopped = True
                    return self._emit(self.pending[:cut])
        if final:
            return self._emit(self.pending)
        keep = min(self.hold, len(self.pending)) if self.stops else 0
        return self._emit(self.pending[:len(self.pending) - keep])

    def _emit(self, out: str) -> str:
        self.pending = self.pending[len(out):]
        self.text += out
        return out


def _first_stop(text: str, stops: Tuple[str, ...]) -> Optional[int]:
    """Where the earliest stop string starts in ``text``, or ``None``."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None
