"""What a run cost in virtual time: the GPU bubble, measured.

The bubble is idle time on the compute queue between its first and its last
work. A gap is charged to the step whose work ends it: a gap before a
forward is bookkeeping the forward waited for (the blocking loop's bubble);
a gap before a sampling is a finalize that came late (a constrained step
held behind the previous commit; seed).
"""

from __future__ import annotations

import attrs

from bubblefree.fake_backend.clock import Clock


@attrs.frozen
class Stats:
    steps: int  # forwards enqueued (a refused launch is not a step)
    host_time: float  # the host clock now
    gpu_busy: float  # compute queue: forwards + samplings
    gpu_idle: float  # compute queue idle between its first start and its last end
    idle_per_step: tuple[tuple[int, float], ...]  # (step_id, idle charged to it), launch order
    gpu_first: float  # first compute start (0 if none)
    gpu_last: float  # last compute end (0 if none)
    copy_busy: float  # copy queue
    makespan: float  # when both host and device are done

    @property
    def gpu_span(self) -> float:
        return self.gpu_last - self.gpu_first


def measure(clock: Clock) -> Stats:
    busy = idle = 0.0
    per_step: dict[int, float] = {}
    steps = 0
    prev_end: float | None = None
    for step_id, what, start, end in clock.compute.intervals:
        gap = 0.0 if prev_end is None else start - prev_end
        per_step[step_id] = per_step.get(step_id, 0.0) + gap
        idle += gap
        busy += end - start
        steps += what == "forward"
        prev_end = end
    intervals = clock.compute.intervals
    first = intervals[0][2] if intervals else 0.0
    last = intervals[-1][3] if intervals else 0.0
    copy_busy = sum(end - start for _, _, start, end in clock.copy.intervals)
    device_end = max(last, clock.copy.free_at)
    return Stats(steps=steps, host_time=clock.host, gpu_busy=busy, gpu_idle=idle,
                 idle_per_step=tuple(per_step.items()), gpu_first=first, gpu_last=last,
                 copy_busy=copy_busy, makespan=max(clock.host, device_end))
