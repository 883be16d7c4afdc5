"""Run the builder's per-shard tasks on a Ray cluster (`--executor ray [--ray-address ADDR]`).

Tasks are the same plain functions the local executor runs (finish_shard, the feature task),
so outputs are byte-identical. A task whose worker dies is retried (max_retries); a build
that crashes resumes from completed shards like a local one. Without an address a local
Ray instance is started (and shut down afterwards); with one, the cluster is left running.
"""

from __future__ import annotations

MAX_RETRIES = 3


class RayExecutor:
    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        import ray

        self.ray = ray
        self.started = not ray.is_initialized()
        if self.started:
            ray.init(
                address=address,
                num_cpus=num_cpus if address is None else None,
                include_dashboard=False,
                log_to_driver=False,
                ignore_reinit_error=True,
            )
        self.pending: list = []
        self._remote: dict = {}

    def submit(self, fn, *args) -> None:
        r = self._remote.get(fn)
        if r is None:
            r = self._remote[fn] = self.ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(fn)
        self.pending.append(r.remote(*args))

    def results(self) -> list:
        out = self.ray.get(self.pending)
        self.pending = []
        return out

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
