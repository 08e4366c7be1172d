"""DataParallelWave: when a replica of --data-parallel-size N --enable-expert-parallel steps.

The replicas share each MoE layer's experts, so they step together or not at all: a replica with
nothing scheduled still steps (an empty batch: only the MoE exchanges) while any other has work.
A wave is a run of such steps. It starts on every replica when the API server sends a request to
any of them: the server numbers requests and sends every replica StartWave(n) with request n
(DataParallelClient). Each step opens with a vote of all replicas (distributed/data_parallel.py
step_vote) on (unfinished requests, newest wave seen); they step again while any has unfinished
requests or they have not all seen the same wave, and all stop at the same step.

Why the second condition: request n reaches replica 0 just after replica 0 read its messages,
while replica 1 already read StartWave(n). With unfinished requests alone both would vote 0 and
stop, and replica 0 would then step alone for request n and wait forever in the first exchange;
with the waves 1 votes n, 0 votes n - 1, so they step once more and 0 takes the request.

Invariant: a replica that has read StartWave(n) steps at least once more, so it meets every other
replica's next step. Pure Python: no torch import.
"""

from __future__ import annotations


class DataParallelWave:
    def __init__(self) -> None:
        self.seen = 0  # the newest wave (request number) this replica has read
        self.active = False  # step even with nothing to schedule

    def start(self, wave: int) -> None:
        """StartWave(wave) read: step at least once more."""
        self.seen, self.active = max(self.seen, wave), True

    def vote(self, unfinished: int) -> tuple[int, int]:
        """What this replica brings to the step's vote (SchedulerOutput.dp_wave)."""
        return unfinished, self.seen

    def voted(self, keep_stepping: bool) -> None:
        """The vote's outcome, the same on every replica."""
        self.active = keep_stepping


def keep_stepping(votes: list[tuple[int, int]]) -> bool:
    """The replicas' votes (unfinished requests, newest wave seen), one each -> whether they all
    step again: [(0, 7), (0, 7)] -> False; [(1, 7), (0, 7)] -> True; [(0, 6), (0, 7)] -> True."""
    waves = [wave for _, wave in votes]
    return any(unfinished for unfinished, _ in votes) or max(waves) != min(waves)

