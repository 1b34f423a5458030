"""An independent, high-frequency /health prober (edge): when did each server first answer 200?

Each watched URL gets a thread that sends GET every ``interval`` seconds until
the first 200 and records that moment (time.monotonic()). The benchmark compares
it with when the harness noticed readiness.
"""

from __future__ import annotations

import http.client
import threading
import time
from urllib.parse import urlsplit

from pd_sessions.runtime.cluster import Event


class HealthProber:
    def __init__(self, interval: float = 0.01, timeout: float = 1.0):
        self.interval = interval
        self.timeout = timeout
        self.first_ok: dict[str, float] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def watch(self, name: str, url: str) -> None:
        th = threading.Thread(target=self._probe, args=(name, url), name=f"probe-{name}", daemon=True)
        th.start()
        self._threads.append(th)

    def on_event(self, event: Event) -> None:
        """A running_cluster observer: probe every process as soon as it is spawned."""
        if event.kind == "spawned" and event.health_url:
            self.watch(event.name, event.health_url)

    def wait_seen(self, names: list[str]) -> None:
        """Until the prober has seen each of ``names`` answer 200, at most one probe timeout
        and a second: called once the driver itself saw them ready, before it stops them (a
        loaded host may run the driver's probe first; stopped at once, the server would never
        answer the prober)."""
        end = time.monotonic() + self.timeout + 1.0
        while any(n not in self.first_ok for n in names) and time.monotonic() < end:
            time.sleep(self.interval)

    def close(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(timeout=self.timeout + 1)
        self._threads.clear()

    def __enter__(self) -> HealthProber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _probe(self, name: str, url: str) -> None:
        u = urlsplit(url)
        assert u.hostname and u.port
        while not self._stop.is_set():
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.timeout)
            try:
                conn.request("GET", u.path or "/")
                if conn.getresponse().status == 200:
                    self.first_ok[name] = time.monotonic()
                    return
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            self._stop.wait(self.interval)
