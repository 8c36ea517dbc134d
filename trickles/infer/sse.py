"""Server-sent events of one request: results cross from the engine's thread to the request's event loop
(:class:`Mailbox`, one wake-up per burst), and :func:`event_stream` turns them into ``data: {chunk}`` lines, ``data:
[DONE]`` at the end; closing the stream early cancels what is still decoding."""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import Callable

from .http import error_body
from .protocol import usage
from .requests import Event

__all__ = ["Mailbox", "event_stream"]


class Mailbox:
    """Hands items from the engine's thread to queues of one event loop, waking the loop once per burst rather than
    once per item (an iteration of the engine posts a token to every running sequence)."""

    _boxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock, self.scheduled = loop, [], threading.Lock(), False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        box = cls._boxes.get(loop)
        if box is None:
            box = cls._boxes[loop] = cls(loop)
        return box

    def __call__(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for queue, item in items:
            queue.put_nowait(item)


async def event_stream(
    events: asyncio.Queue,
    prompts: int,
    n: int,
    head: dict,
    chunk: Callable,
    include_usage: bool,
    cancel: Callable[[], None],
):
    """Server-sent events of one request; closing the stream early cancels what is still decoding. ``chunk(k, event,
    first, records)`` makes choice ``k``'s chunk of ``event``, ``records`` the log-probabilities of the tokens drawn
    since its last chunk (a token whose text is held back sends no chunk of its own)."""
    done, started, results, failed = 0, set(), [], False
    pending: dict[int, list] = {}
    try:
        while done < prompts and not failed:
            out = []
            kind, i, x = await events.get()
            while True:  # everything already queued goes out in one write
                if kind == "done":
                    done += 1
                    if isinstance(x, BaseException):
                        out.append(f"data: {json.dumps(error_body(f'decoding failed: {x}', 'server_error'))}\n\n")
                        failed = True
                        break
                    results.extend(x)
                else:
                    ev: Event = x
                    k = i * n + ev.row
                    if ev.logprob is not None:
                        pending.setdefault(k, []).append(ev.logprob)
                    if ev.text or ev.finish_reason is not None or k not in started:
                        out.append(f"data: {json.dumps(chunk(k, ev, k not in started, pending.pop(k, [])))}\n\n")
                        started.add(k)
                if events.empty():
                    break
                kind, i, x = events.get_nowait()
            if out:
                yield "".join(out)
        if include_usage and done == prompts and not failed:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(results)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if done < prompts:
            cancel()
