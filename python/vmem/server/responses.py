"""A checked request run through the engine and answered in OpenAI's shapes: a whole response,
or a stream of server-sent events (chunks, the usage chunk when ``stream_options.include_usage``,
then ``data: [DONE]``).

Each choice is one engine request. Whatever ends the exchange (the last token, a stop string,
an error, the client going away) releases every choice (:meth:`Engine.release`): one that has
not finished is cancelled in the engine and its pages unmapped.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi.sse import format_sse_event

from .engine import Engine, Request
from .errors import ApiError
from .protocol import Job
from .text import TextStream


class Choice:
    """One choice: its engine request, its text so far, why it finished."""

    def __init__(self, index: int, request: Request, text: TextStream) -> None:
        self.index, self.request, self.text = index, request, text
        self.finish_reason: Optional[str] = None

    async def step(self, eos: Tuple[int, ...]) -> str:
        """The text the next tokens add (sets :attr:`finish_reason` when the choice is over)."""
        new, finished = await self.request.next()
        out = self.text.push(new, final=finished)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif finished:
            tokens = self.request.output.generated_tokens
            self.finish_reason = "stop" if tokens and tokens[-1] in eos else "length"
        return out

    @property
    def tokens(self) -> int:
        """Completion tokens this choice generated (up to its stop string)."""
        return self.request.sent


class Exchange:
    """One API request's choices in the engine (``prompts``: token ids, one per prompt; ``n``
    choices each)."""

    def __init__(self, engine: Engine, job: Job, prompts: List[List[int]], max_tokens: List[int], chat: bool) -> None:
        self.engine, self.job, self.chat = engine, job, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p) for p in prompts)
        eos = engine.eos
        self.eos: Tuple[int, ...] = () if job.params.ignore_eos else tuple(eos if isinstance(eos, list) else [eos])
        params, n = job.params, job.params.n
        self.choices: List[Choice] = []
        streaming = job.stream or bool(params.stop)
        try:
            for i, (ids, mt) in enumerate(zip(prompts, max_tokens)):
                for j in range(n):
                    seed = None if params.seed is None else params.seed + j
                    request = engine.submit(ids, mt, params, seed, streaming)
                    self.choices.append(Choice(i * n + j, request, TextStream(engine.tokenizer, ids, params.stop)))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Every choice leaves the engine (cancelled there if not finished)."""
        for c in self.choices:
            self.engine.release(c.request)
            self.engine.metrics.finished(c.finish_reason or "cancelled")

    def usage(self) -> Dict[str, int]:
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _chunk(self, choices: List[Dict[str, Any]], usage: Optional[Dict[str, int]] = None) -> bytes:
        body: Dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                "created": self.created, "model": self.job.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return format_sse_event(data_str=json.dumps(body, ensure_ascii=False, separators=(",", ":")))

    def _piece(self, c: Choice, text: str, first: bool = False) -> Dict[str, Any]:
        if self.chat:
            delta: Dict[str, Any] = {"role": "assistant", "content": text} if first else \
                ({"content": text} if text or c.finish_reason is None else {})
            return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": c.finish_reason}
        return {"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}

    # -- a whole response ------------------------------------------------------------------------
    async def collect(self) -> Dict[str, Any]:
        """Runs every choice to its end; the response body."""
        async def run(c: Choice) -> str:
            parts = []
            while c.finish_reason is None:
                parts.append(await c.step(self.eos))
            return "".join(parts)

        tasks = [asyncio.ensure_future(run(c)) for c in self.choices]
        try:
            texts = await asyncio.gather(*tasks)
        finally:  # an error in one choice, or the client gone: the others stop too
            for t in tasks:
                t.cancel()
            self.release()
        if self.chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": t}, "logprobs": None,
                        "finish_reason": c.finish_reason} for c, t in zip(self.choices, texts)]
        else:
            choices = [{"index": c.index, "text": t, "logprobs": None, "finish_reason": c.finish_reason}
                       for c, t in zip(self.choices, texts)]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.job.model, "choices": choices, "usage": self.usage()}

    # -- a stream ---------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        """The SSE stream; cancelled (the client left) or done, every choice is released."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                while c.finish_reason is None:
                    text = await c.step(self.eos)
                    if text or c.finish_reason is not None:
                        queue.put_nowait((c, text, None))
            except ApiError as e:
                queue.put_nowait((c, "", e))

        tasks: List[asyncio.Task] = []
        try:
            if self.chat:
                yield self._chunk([self._piece(c, "", first=True) for c in self.choices])
            tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
            left = len(self.choices)
            while left:
                c, text, error = await queue.get()
                if error is not None:
                    yield format_sse_event(data_str=json.dumps(error.body()))
                    return
                if c.finish_reason is not None:
                    left -= 1
                yield self._chunk([self._piece(c, text)])
            if self.job.include_usage:
                yield self._chunk([], usage=self.usage())
            yield format_sse_event(data_str="[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            self.release()
