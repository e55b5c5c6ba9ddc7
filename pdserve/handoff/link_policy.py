"""The hand-off adapts to the link: what each peer's link gives (LinkMeter, from completed
transfers) and, per request, where a decode worker takes the prompt's KV from
(KVSourcePolicy.choose): moved from the prefill worker's node, loaded from the fleet store, or
recomputed here, whichever is predicted fastest.

    predicted seconds      transfer = KV bytes / the source's measured bytes per second
                           store    = KV bytes / the fleet store's measured bytes per second
                           recompute = prompt tokens x this worker's prefill seconds per token

The rule (choose), in order:
  1. A link not measured yet, or measured longer than STALE_S ago: transfer (today's path;
     it measures the link, so a link that got faster is seen again). A re-measure that
     finds the link no faster (within MARGIN) doubles how long its rate is trusted, up to
     MAX_STALE_S: on a slow link each such probe costs a whole prompt's transfer.
  2. This worker's prefill speed unknown (it never computed a prompt) and the transfer
     predicted longer than EXPLORE_S: recompute, which measures the speed (its steps), so
     that a slow link is not paid for ever for want of the other number.
  3. Otherwise the fastest of the three, where the store or the recompute is known (a store
     read measured, a prefill speed measured); it replaces the transfer only when predicted
     faster by MARGIN, so that noise in the estimates does not flip requests back and forth.
Recompute needs no bytes and no peer: it is what happens anyway when a transfer fails. A
pull that starts with the prefill's forward (a follow) crosses while the prompt computes:
the caller says how much of it that hides (`overlap_s`), and only the rest is charged.

Rates are of KV bytes delivered (decoded: an FP8 wire, pdserve/handoff/wire_fp8.py, counts
the bytes it stands for), so a prediction from a prompt's KV bytes holds whatever the wire.
A transfer's round trip is one sample; under MIN_SAMPLE_BYTES its latency, not the link,
decides, and it is not counted. A layer pull's round trip (pdserve/handoff/layer_pull.py) may
include waiting for the prefill's next layer (at most its WAIT_S, 50 ms: little beside a
layer's time on a link slow enough to matter): its rate is only a lower bound on the link's,
and raises the estimate but never lowers it (a peer's first sample sets it, whatever it is,
and so does any sample once its rate is STALE_S old: a link that slowed is seen again). A
read that timed out is an upper bound (the bytes asked / the seconds waited): it lowers the
rate, never raises it, so a link too slow for the timeout is not taken for a fast one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Literal

KVSource = Literal["transfer", "store", "recompute"]
KV_SOURCES: tuple[KVSource, ...] = ("transfer", "store", "recompute")

STORE = ""
"""The fleet store's name among the peers (a hand-off's `source` "" is the store)."""
EMA = 0.3
"""Weight of a new sample in a peer's smoothed rate."""
MIN_SAMPLE_BYTES = 256 << 10
"""Smaller transfers are latency, not bandwidth: not counted."""
STALE_S = 30.0
"""A peer's rate older than this is not trusted: the next hand-off from it transfers..."""
MAX_STALE_S = 480.0
"""...and each re-measure that finds it no faster doubles that, up to this."""
MARGIN = 1.25
"""Another source replaces the transfer only when predicted this many times faster."""
MIN_TIMEOUT_S = 0.5
"""A read that failed sooner did not wait for the link (refused, unknown): no bound."""
EXPLORE_S = 1.0
"""A transfer predicted this long is worth one recompute to learn the prefill speed."""
MAX_PEERS = 64
"""Peers remembered (the least recently measured forgotten first)."""


@dataclass
class LinkRate:
    """One peer's smoothed rate: KV bytes per second, when it was last sampled, and how long
    it is trusted."""

    bytes_per_s: float
    measured_s: float
    num_samples: int = 1
    stale_s: float = STALE_S

    def is_stale(self, now_s: float) -> bool:
        return now_s - self.measured_s > self.stale_s


class LinkMeter:
    """Per peer address, the KV bytes per second its completed transfers gave (an
    exponentially smoothed mean). Thread safe: transfers complete on the connector's job
    thread, the choice reads it on the worker's loop."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rates: dict[str, LinkRate] = {}

    def note(self, peer: str, nbytes: int, seconds: float, lower_bound: bool = False,
             upper_bound: bool = False) -> None:
        """A transfer from `peer` ("" the fleet store) delivered `nbytes` in `seconds`;
        `lower_bound`: its time may include waiting for the data (a layer pull);
        `upper_bound`: it timed out after `seconds` with `nbytes` asked for, so the link is
        at most that fast (a link too slow for the read's timeout is still measured)."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0 or (
                upper_bound and seconds < MIN_TIMEOUT_S):
            return
        rate, now_s = nbytes / seconds, self._clock()
        with self._lock:
            known = self._rates.get(peer)
            if upper_bound:
                if known is None or known.is_stale(now_s) or rate < known.bytes_per_s:
                    self._rates[peer] = LinkRate(rate, now_s)
                return
            if known is None or known.is_stale(now_s):  # (a stale rate is gone)
                # a re-measure that finds the link no faster trusts it twice as long: each
                # probe of a slow link costs a whole transfer over it
                stale_s = (min(2 * known.stale_s, MAX_STALE_S)
                           if known is not None and rate <= MARGIN * known.bytes_per_s
                           else STALE_S)
                self._rates[peer] = LinkRate(rate, now_s, stale_s=stale_s)
                while len(self._rates) > MAX_PEERS:
                    oldest = min(self._rates, key=lambda p: self._rates[p].measured_s)
                    del self._rates[oldest]
                return
            if lower_bound and rate <= known.bytes_per_s:
                return  # (a pull that waited says nothing new about the link)
            known.bytes_per_s += EMA * (rate - known.bytes_per_s)
            known.measured_s = now_s
            known.num_samples += 1

    def bytes_per_s(self, peer: str) -> float | None:
        """The peer's rate; None where never measured or STALE_S old."""
        with self._lock:
            known = self._rates.get(peer)
            if known is None or known.is_stale(self._clock()):
                return None
            return known.bytes_per_s

    def as_status(self) -> dict[str, float]:
        """`link_bytes_per_s:<peer>` for each peer measured ("store" for the fleet store)."""
        with self._lock:
            return {f"link_bytes_per_s:{peer or 'store'}": rate.bytes_per_s
                    for peer, rate in self._rates.items()}


@dataclass(frozen=True)
class Prediction:
    """What choose compared: predicted seconds per source (None: unknown)."""

    transfer_s: float | None
    store_s: float | None
    recompute_s: float | None


class KVSourcePolicy:
    """Where a hand-off's KV comes from (the module docstring's rule), over a LinkMeter."""

    def __init__(self, links: LinkMeter, has_store: bool) -> None:
        self.links = links
        self.has_store = has_store
        """A fleet store to load from (the transport has one)."""

    def predict(self, num_tokens: int, num_bytes: int, source: str,
                prefill_s_per_token: float | None) -> Prediction:
        """Predicted seconds of each source for a prompt of `num_tokens` whose KV is
        `num_bytes`, offered at `source` ("" the fleet store)."""
        def over(peer: str) -> float | None:
            rate = self.links.bytes_per_s(peer)
            return None if rate is None else num_bytes / rate

        store_s = over(STORE) if self.has_store and source != STORE else None
        recompute_s = (num_tokens * prefill_s_per_token
                       if prefill_s_per_token is not None else None)
        return Prediction(over(source), store_s, recompute_s)

    def choose(self, num_tokens: int, num_bytes: int, source: str,
               prefill_s_per_token: float | None, can_recompute: bool = True,
               overlap_s: float = 0.0) -> KVSource:
        """The source predicted fastest (the rule in the module docstring). `overlap_s`: the
        part of a transfer hidden behind the prefill's forward (a pull that starts as it
        does); the transfer is charged only the rest. Side-effect free: the caller counts
        what it did."""
        predicted = self.predict(num_tokens, num_bytes, source,
                                 prefill_s_per_token if can_recompute else None)
        if predicted.transfer_s is not None and overlap_s > 0:
            predicted = Prediction(max(0.0, predicted.transfer_s - overlap_s),
                                   predicted.store_s, predicted.recompute_s)
        if (can_recompute and prefill_s_per_token is None and predicted.transfer_s is not None
                and predicted.transfer_s > EXPLORE_S):
            return "recompute"  # (rule 2: it measures the prefill speed)
        return choose_from(predicted)

    def reads_store_first(self, num_bytes: int, source: str) -> bool:
        """Load the offer from the fleet store before its source (the store is predicted
        faster: the same rule without recompute); the source serves what the store lacks."""
        return self.choose(0, num_bytes, source, None, can_recompute=False) == "store"


def choose_from(predicted: Prediction) -> KVSource:
    """The rule on predicted times: transfer, unless its link is measured and another known
    source beats it by MARGIN (ties between those two: the store, which costs no compute)."""
    transfer_s = predicted.transfer_s
    if transfer_s is None:
        return "transfer"
    others: list[tuple[float, KVSource]] = [
        (seconds, name) for seconds, name in ((predicted.store_s, "store"),
                                              (predicted.recompute_s, "recompute"))
        if seconds is not None]
    if not others:
        return "transfer"
    best_s, best = min(others, key=lambda other: (other[0], other[1] != "store"))
    return best if best_s * MARGIN < transfer_s else "transfer"
