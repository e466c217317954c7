"""The status panel's view of the last minutes: tokens per second bins, first-token times and
finishes, kept for a bounded window (thread-safe; the event loop records)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class RecentActivity:
    """What the status panel shows about the last minutes (from finished and streaming requests)."""

    tokens_per_s: float  # generated tokens per second over the window (all routes)
    tokens: int  # generated tokens in the window
    requests_finished: int  # requests finished in the window
    mean_ttft_s: float | None  # mean time to first token of requests started in the window
    throughput: list[tuple[float, float]] = field(default_factory=list)  # (unix time, tokens/s) per bin
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (unix time of first token, seconds)


class RecentWindow:
    """Recent activity over `recent_window_s` seconds, fed by every request's tracker."""

    def __init__(self, recent_window_s: float = 600.0):
        self.recent_window_s = recent_window_s
        self._lock = threading.Lock()
        self._token_bins: deque[list] = deque()  # [unix second, tokens generated in that second]
        self._first_tokens: deque[tuple[float, float]] = deque()  # (unix time, ttft seconds)
        self._finishes: deque[float] = deque()  # unix time of each finish

    def _prune(self, now: float) -> None:
        horizon = now - self.recent_window_s
        while self._token_bins and self._token_bins[0][0] < horizon:
            self._token_bins.popleft()
        while self._first_tokens and self._first_tokens[0][0] < horizon:
            self._first_tokens.popleft()
        while self._finishes and self._finishes[0] < horizon:
            self._finishes.popleft()

    def note_tokens(self, count: int) -> None:
        now = time.time()
        second = int(now)
        with self._lock:
            if self._token_bins and self._token_bins[-1][0] == second:
                self._token_bins[-1][1] += count
            else:
                self._token_bins.append([second, count])
            self._prune(now)

    def note_first_token(self, ttft: float) -> None:
        with self._lock:
            self._first_tokens.append((time.time(), max(0.0, ttft)))

    def note_finished(self) -> None:
        with self._lock:
            self._finishes.append(time.time())

    def recent(self, window_s: float = 60.0, bin_s: float = 5.0, history_s: float = 300.0,
               now: float | None = None) -> RecentActivity:
        """Tokens/s over the last `window_s`; throughput per `bin_s` and TTFTs over `history_s`."""
        now = time.time() if now is None else now
        with self._lock:
            self._prune(now)
            bins = [tuple(b) for b in self._token_bins]
            first_tokens = list(self._first_tokens)
            finishes = list(self._finishes)
        tokens = sum(count for second, count in bins if second > now - window_s)
        window_ttfts = [ttft for at, ttft in first_tokens if at > now - window_s]
        last_full_bin = (now // bin_s) * bin_s  # the bin now is in is still filling: not plotted
        num_bins = max(1, int(history_s // bin_s))
        per_bin = {}
        for second, count in bins:
            start = (second // bin_s) * bin_s
            per_bin[start] = per_bin.get(start, 0) + count
        throughput = [(start, per_bin.get(start, 0) / bin_s)
                      for start in (last_full_bin - bin_s * k for k in range(num_bins, 0, -1))]
        return RecentActivity(
            tokens_per_s=tokens / window_s,
            tokens=tokens,
            requests_finished=sum(1 for at in finishes if at > now - window_s),
            mean_ttft_s=(sum(window_ttfts) / len(window_ttfts)) if window_ttfts else None,
            throughput=throughput,
            ttft=[(at, ttft) for at, ttft in first_tokens if at > now - history_s],
        )
