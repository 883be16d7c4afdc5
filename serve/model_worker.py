"""The model's requests (completions, scoring) in a process of their own.

The server's process answers index queries; the model, its gate and the index lookups of
generation run in a child process that opens the same index (its files are shared through the
page cache). Both are Python: in one process the model's decode loop held the interpreter that
the event loop needs to read and answer every request, so under load a count waited behind
model work (serve_load_2b). The child takes one request at a time, as the model's lock allowed
before; the parent holds that lock for the length of each request, streams included.

Messages, over one pipe. Parent to child: (kind, request fields), kind "complete" or "score";
("cancel",) while a stream runs, when its client is gone. Child to parent: ("ready", model info)
or ("failed", message) once at start; then per request ("json", body bytes, draft stats),
("error", status, message, draft stats), or a stream's ("chunk", text)... then ("end", draft
stats).
"""

from __future__ import annotations

import multiprocessing as mp
import threading

from fastapi.responses import Response
from teragram.index.errors import ClusterError, TeragramError
from teragram.serve.lanes import acquire

ENDED = "the model's process has ended; restart the server"


class ModelProcessError(TeragramError):
    """The model's process ended or refused a request: (status, message)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def answer(conn, handlers: dict, requests: dict, drafts) -> None:
    """The child's side, once it has sent ("ready", ...): answer requests one by one until the
    parent goes. handlers[kind](requests[kind](**fields)) gives a JSON Response or a stream's
    chunks; drafts() the draft statistics sent with each answer."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        kind, fields = msg[0], msg[1] if len(msg) > 1 else None
        if kind not in handlers:
            continue  # a cancel that came after its stream ended
        try:
            out = handlers[kind](requests[kind](**fields))
            if isinstance(out, Response):
                conn.send(("json", bytes(out.body), drafts()))
                continue
            for chunk in out:  # a stream: stop when its client is gone
                if conn.poll() and conn.recv()[0] == "cancel":
                    out.close()
                    break
                conn.send(("chunk", chunk))
            conn.send(("end", drafts()))
        except TeragramError as e:
            conn.send(("error", 503 if isinstance(e, ClusterError) else 400, str(e), drafts()))
        except Exception as e:  # noqa: BLE001  (the request fails with 500, the process goes on)
            conn.send(("error", 500, f"{type(e).__name__}: {e}", drafts()))


class ModelWorker:
    """The parent's side: start the child, then one request at a time under `lock`."""

    def __init__(self, target, cfg, lock: threading.Lock):
        """target(cfg, conn): the child, a module-level function (spawned, not forked)."""
        ctx = mp.get_context("spawn")  # no fork of a process with threads and open memory maps
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(cfg, child), daemon=True, name="teragram-model")
        self.proc.start()
        child.close()
        self.lock = lock
        self.drafts: dict | None = None  # the child's draft statistics after its latest request
        kind, info = self._recv()
        if kind != "ready":
            self.proc.join(10)
            raise TeragramError(info)
        self.info = info

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise ModelProcessError(503, ENDED) from None

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # a broken pipe
            raise ModelProcessError(503, ENDED) from None

    def call(self, kind: str, req) -> Response | _Stream:
        """The response to a completion or scoring request: JSON, or a stream of its chunks
        (the lock is held until the stream ends, is closed or is dropped). A request cancelled
        while it waits for the lock stops waiting (lanes.acquire); once sent, it runs to its end."""
        acquire(self.lock)
        try:
            self._send((kind, req.model_dump()))
            msg = self._recv()
        except BaseException:
            self.lock.release()
            raise
        if msg[0] == "chunk":
            return _Stream(self, msg)
        self.lock.release()
        self.drafts = msg[-1]
        if msg[0] == "error":
            raise ModelProcessError(msg[1], msg[2])
        return Response(msg[1], media_type="application/json")

    def close(self) -> None:
        self.conn.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


class _Stream:
    """A streamed completion's chunks from the child. The worker's lock is released when the
    stream ends, is closed (its client gone: the child is told to stop, and what it sent is
    read off) or is dropped unread."""

    def __init__(self, worker: ModelWorker, first: tuple):
        self.w, self.pending, self.open = worker, first, True

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> str:
        if not self.open:
            raise StopIteration
        msg, self.pending = self.pending, None
        try:
            msg = msg or self.w._recv()
        except BaseException:
            self._release()
            raise
        if msg[0] == "chunk":
            return msg[1]
        self.w.drafts = msg[-1]
        self._release()
        if msg[0] == "error":
            raise ModelProcessError(msg[1], msg[2])
        raise StopIteration

    def close(self) -> None:
        if not self.open:
            return
        try:
            self.w._send(("cancel",))
            msg = ("chunk",)
            while msg[0] == "chunk":
                msg = self.w._recv()
            self.w.drafts = msg[-1]
        finally:
            self._release()

    def _release(self) -> None:
        if self.open:
            self.open = False
            self.w.lock.release()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (the child has ended: nothing to read off)
            pass
