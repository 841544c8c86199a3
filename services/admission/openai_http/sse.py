"""Server-Sent Events exactly as OpenAI sends them.

Chat: per choice a first chunk with the role, then content deltas (with tools: only the text
that is surely no part of a call; a call is held back until it is complete and parsed, then
sent whole as one `tool_calls` delta), then a chunk with the finish reason; then, when
`stream_options.include_usage` asked for it, one chunk with empty choices and the usage;
`data: [DONE]` last. Completions: the same without the role chunk. An error after the stream
began is one `data: {"error": ...}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from kvmesh.client import Chunk, GenerationResult
from kvmesh.tool_format import free_text_end, split_answer
from services.admission.openai_http import schemas, translation
from services.admission.openai_http.generation import Event, Generation
from services.admission.openai_http.translation import Plan

DONE = b"data: [DONE]\n\n"

TEXT_SLOT = "kvmesh:text-slot"
"""Stands in for a content chunk's text in the frame written once per choice (see _text)."""

_NO_EXTRAS = {"kvmesh": True, "choices": {"__all__": {"kvmesh_finish_reason"}}}
"""Content chunks carry neither kvmesh's reason nor its info object (both only at the end)."""


def frame(payload: BaseModel, exclude: Any = None) -> bytes:
    """One SSE event holding a JSON body."""
    return b"data: " + payload.model_dump_json(exclude=exclude).encode() + b"\n\n"


class StreamTranslator:
    """Turns one plan's events into the chunks OpenAI would have sent."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._id = ""
        self._models: dict[int, str] = {}
        self._results: dict[int, GenerationResult] = {}
        self._texts: dict[int, str] = {}
        """Each chat choice's text so far."""
        self._sent: dict[int, int] = {}
        """How much of it went out as content."""
        self._text_frames: dict[int, tuple[bytes, bytes]] = {}
        """Each choice's content-chunk frame before and after its text (see _text)."""
        self._content_exclude: dict[str, Any] = dict(_NO_EXTRAS)
        self._final_exclude: dict[str, Any] = {}
        if not plan.include_usage:
            self._content_exclude["usage"] = True
            self._final_exclude["usage"] = True

    def frames(self, event: Event) -> list[bytes]:
        """The SSE events for one gateway event (none for some)."""
        if event.error is not None:
            return [frame(translation.http_error(event.error, self._plan).body)]
        if event.started is not None:
            self._id = self._id or translation.response_id(self._plan, event.started.request_id)
            self._models[event.choice] = event.started.model
            if self._plan.kind == "chat":
                return [self._chat(event.choice, schemas.Delta(role="assistant", content=""))]
            return []
        if event.chunk is not None:
            chunk = event.chunk
            if not chunk.text and not chunk.logprobs:
                return []
            if self._plan.kind == "chat":
                content = self._content(event.choice, chunk.text)
                if not content and not chunk.logprobs:
                    return []
                if not self._plan.logprobs:
                    return [self._text(event.choice, content)]
                logprobs = translation.chat_logprobs(chunk.logprobs)
                return [self._chat(event.choice, schemas.Delta(content=content), logprobs)]
            if not self._plan.logprobs:
                return [self._text(event.choice, chunk.text)]
            return [self._completion_text(event)]
        assert event.result is not None
        self._results[event.choice] = event.result
        if self._plan.kind == "chat":
            return [
                *self._held_back(event.choice, event.result),
                self._finish(event.choice, event.result),
            ]
        return [self._finish(event.choice, event.result)]

    def _content(self, choice: int, text: str) -> str:
        """The part of the choice's text that can go out as content now."""
        so_far = self._texts.get(choice, "") + text
        self._texts[choice] = so_far
        answer = self._plan.tool_answer
        end = len(so_far) if answer == "text" else free_text_end(so_far) if answer == "auto" else 0
        sent = self._sent.get(choice, 0)
        self._sent[choice] = max(sent, end)
        return so_far[sent:end]

    def _held_back(self, choice: int, result: GenerationResult) -> list[bytes]:
        """At the end: the content still held back, and the parsed call (whole, one delta)."""
        text = self._texts.get(choice, "")
        content_end = len(split_answer(text)[0]) if result.tool_calls else len(text)
        if self._plan.tool_answer == "call" and result.tool_calls:
            content_end = 0
        frames = []
        rest = text[self._sent.get(choice, 0) : content_end]
        if rest:
            frames.append(self._chat(choice, schemas.Delta(content=rest)))
        calls = [
            schemas.ToolCallDelta(index=index, id=call.id, function=call.function)
            for index, call in enumerate(translation.tool_calls(result))
        ]
        if calls:
            frames.append(self._chat(choice, schemas.Delta(tool_calls=calls)))
        return frames

    def all_finished(self) -> bool:
        """Every choice has its result (what follows is the usage chunk and [DONE])."""
        return len(self._results) == len(self._plan.requests)

    def usage_frame(self) -> bytes:
        """The last chunk before [DONE], when the request asked for usage."""
        results = [self._results[i] for i in sorted(self._results)]
        usage = translation.usage(self._plan, results)
        info = translation.kvmesh_info(self._plan, results)
        common: dict[str, Any] = {
            "id": self._id,
            "created": self._plan.created,
            "model": results[0].model,
        }
        body: BaseModel
        if self._plan.kind == "chat":
            body = schemas.ChatCompletionChunk(**common, choices=[], usage=usage, kvmesh=info)
        else:
            body = schemas.CompletionChunk(**common, choices=[], usage=usage, kvmesh=info)
        return frame(body)

    def _chat(
        self, choice: int, delta: schemas.Delta, logprobs: schemas.ChatLogprobs | None = None
    ) -> bytes:
        body = schemas.ChatCompletionChunk(
            id=self._id,
            created=self._plan.created,
            model=self._models[choice],
            choices=[schemas.ChatChunkChoice(index=choice, delta=delta, logprobs=logprobs)],
        )
        return frame(body, self._content_exclude)

    def _text(self, choice: int, text: str) -> bytes:
        """A content chunk without logprobs: the choice's chunk frame, written by pydantic once
        with TEXT_SLOT for its text, around this text as a JSON string (the same bytes, with
        no model built per chunk)."""
        around = self._text_frames.get(choice)
        if around is None:
            if self._plan.kind == "chat":
                whole = self._chat(choice, schemas.Delta(content=TEXT_SLOT))
            else:
                whole = self._completion_text(Event(choice, chunk=Chunk(TEXT_SLOT, ())))
            before, _, after = whole.partition(json.dumps(TEXT_SLOT).encode())
            around = self._text_frames[choice] = (before, after)
        return around[0] + json.dumps(text, ensure_ascii=False).encode() + around[1]

    def _completion_text(self, event: Event) -> bytes:
        assert event.chunk is not None
        logprobs = None
        if self._plan.logprobs:
            logprobs = translation.completion_logprobs(event.chunk.logprobs, [])
        body = schemas.CompletionChunk(
            id=self._id,
            created=self._plan.created,
            model=self._models[event.choice],
            choices=[
                schemas.CompletionChunkChoice(
                    index=event.choice, text=event.chunk.text, logprobs=logprobs
                )
            ],
        )
        return frame(body, self._content_exclude)

    def _finish(self, choice: int, result: GenerationResult) -> bytes:
        reason = translation.finish_reason(result.finish_reason)
        info = translation.kvmesh_info(self._plan, [result])
        common: dict[str, Any] = {
            "id": self._id,
            "created": self._plan.created,
            "model": result.model,
        }
        body: BaseModel
        if self._plan.kind == "chat":
            body = schemas.ChatCompletionChunk(
                **common,
                choices=[
                    schemas.ChatChunkChoice(
                        index=choice,
                        delta=schemas.Delta(),
                        finish_reason=reason,
                        kvmesh_finish_reason=result.finish_reason,
                    )
                ],
                kvmesh=info,
            )
        else:
            body = schemas.CompletionChunk(
                **common,
                choices=[
                    schemas.CompletionChunkChoice(
                        index=choice,
                        text="",
                        finish_reason=reason,
                        kvmesh_finish_reason=result.finish_reason,
                    )
                ],
                kvmesh=info,
            )
        return frame(body, self._final_exclude)


async def event_stream(
    plan: Plan, generation: Generation, events: AsyncIterator[Event], first: Event
) -> AsyncIterator[bytes]:
    """The whole SSE body, from the first event on; leaving early (the client went away)
    cancels every call."""
    translator = StreamTranslator(plan)
    try:
        if data := b"".join(translator.frames(first)):
            yield data
        failed = False
        ending = b""
        async for event in events:
            # The frames of one event in one write, and the last event's with the usage chunk
            # and [DONE]: each write is a send(2) and, the socket being TCP_NODELAY, a packet.
            if data := b"".join(translator.frames(event)):
                if event.result is not None and translator.all_finished():
                    ending = data
                else:
                    yield data
            failed = event.error is not None
        if plan.include_usage and not failed:
            ending += translator.usage_frame()
        yield ending + DONE
    finally:
        await generation.aclose()
