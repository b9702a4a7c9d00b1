"""Writing finished shards in background threads while the target computes the next ones."""

from __future__ import annotations

import queue
import threading


class BackgroundWriter:
    """Runs fn(*job) for queued jobs on `threads` daemon threads, so shards are written while
    the GPU goes on. One job waits at most (put() blocks while one does): a shard's features
    are in memory from capture until written, so at most threads + 2 shards are held (being
    written, waiting, being captured). The first error is raised by put() or close()."""

    def __init__(self, fn, threads: int):
        self.fn = fn
        self.jobs: queue.Queue = queue.Queue(maxsize=1)
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(max(1, threads))]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.errors:
                continue  # drain: after a failure nothing more is written
            try:
                self.fn(*job)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self.errors.append(e)

    def put(self, *job) -> None:
        if self.errors:
            raise self.errors[0]
        self.jobs.put(job)

    def close(self, quiet: bool = False) -> None:
        """Wait for every queued job; raise the first error unless quiet."""
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()
        if self.errors and not quiet:
            raise self.errors[0]
