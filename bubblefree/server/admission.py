"""A bound on live requests: past it, 429 with ``Retry-After`` at once,
rather than a queue that grows until every client times out.

Only the event loop thread touches the count, so it needs no lock.
"""

from __future__ import annotations

from bubblefree.server.errors import ApiError


class Admission:
    def __init__(self, limit: int, retry_after_s: int):
        self.limit, self.retry_after_s = limit, retry_after_s
        self.live = 0

    def enter(self) -> "Ticket":
        if self.live >= self.limit:
            raise ApiError(429, f"request: {self.live} requests are live, the most this server "
                           "takes; retry later", "request",
                           headers={"Retry-After": str(self.retry_after_s)})
        self.live += 1
        return Ticket(self)


class Ticket:
    """One admitted request; ``leave`` is safe to call twice."""

    def __init__(self, admission: Admission):
        self._admission: Admission | None = admission

    def leave(self) -> None:
        if self._admission is not None:
            self._admission.live -= 1
            self._admission = None
