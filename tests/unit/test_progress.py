"""What a person watching sees: training progress as plain lines off a terminal and a bar on one, each step's figures
shown with that step; the server's one line per request."""

from __future__ import annotations

import asyncio
import io

from trickles.infer.http import RequestLog
from trickles.train.progress import Progress


def _record(loss):
    return {"loss": loss, "tokens_per_s": 1234.0, "mfu": None, "flops_per_s": 2e9}


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_progress_is_a_plain_line_every_few_steps():
    out = io.StringIO()
    progress = Progress(0, 45, quiet=False, label="distill loss", stream=out)
    for step in range(1, 46):
        progress.step(step, _record(float(step)))
    progress.write("[trickles] a message")
    progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == "[trickles] step 2/45 distill loss 2.000 tok/s 1,234 GFLOP/s 2.0"
    assert [line.split()[2] for line in lines[:-1]] == [f"{s}/45" for s in range(2, 45, 2)] + ["45/45"]
    assert lines[-1] == "[trickles] a message"


def test_on_a_terminal_the_bar_shows_the_step_it_has_counted():
    out = _Terminal()
    progress = Progress(0, 3, quiet=False, stream=out)
    for step, loss in ((1, 5.5), (2, 4.25)):
        progress.step(step, _record(loss))
        frame = out.getvalue().split("\r")[-1]
        assert f"{step}/3" in frame and f"loss={loss:.3f}" in frame, frame
    progress.close()
    quiet = io.StringIO()
    Progress(0, 3, quiet=True, stream=quiet).step(1, _record(1.0))
    assert quiet.getvalue() == ""


def test_the_server_logs_one_line_per_request_when_its_response_ends():
    async def app(scope, receive, send):  # a streamed response in two pieces
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})

    lines, sent = [], []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "client": ("10.0.0.7", 5000)}
    asyncio.run(RequestLog(app, lines.append)(scope, None, send))
    assert len(sent) == 3 and len(lines) == 1
    assert lines[0].startswith("[trickles] 10.0.0.7 POST /v1/completions 200 ") and lines[0].endswith(" ms")
