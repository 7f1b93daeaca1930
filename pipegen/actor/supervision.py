"""Supervision's constants, one home: every number the request path's supervision is tuned by (attempts.py,
routing.py, sending.py, admission.py), each with its unit and why. What a user sets is config/schema.py's
(`llm.*`, `actors.*`); these are not keys: changing one is a code change, measured by the bench.

Owns: these numbers (`SUPERVISION`). Must never: hold state, do I/O, or be read from a config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Supervision:
    # ---- attempts.py: stalls and hedges ----
    max_copies: int = 3  # attempts: an attempt and its hedges in flight at once (the tail only)
    slower_by: float = 1.5  # ratio: a server this many times slower per token than another is worth a hedge there
    hedge_budget: float = 0.05  # share: hedge copies may cost at most this share of the tokens answered
    load_confirm_s: float = 0.5  # s: evidence against an attempt is read again this often...
    # s: ...and must hold this long, every reading, before it counts as a stall (a prefill in progress, an answer on
    # its way back, are moments)
    suspect_for_s: float = 1.0
    # s: how often the evidence of an attempt the engine has not started is looked at (both plus the engine's
    # load_trails_s: each lost request costs about look_s + suspect_for_s of its unit's time)
    look_s: float = 1.0
    order_slack_s: float = 0.05  # s: attempts sent this close together may reach the engine in either order
    # ---- routing.py: servers and their readings ----
    sticky_cache_size: int = 10000  # keys: sticky keys (a prompt's samples, a session) remembered for their server
    load_fresh_s: float = 0.5  # s: a load reading younger than this answers supervision's question without asking
    starts_kept: int = 4096  # attempts: starts remembered per server (ServerState.starts)
    step_readings_kept: int = 64  # readings: load readings remembered per server (ServerState.step_readings)
    lag_s: float = 1.0  # s: an attempt sent this long before a load reading is surely counted in it
    transit_s: float = 0.1  # s: an attempt sent this long before a reading has reached a healthy engine
    # ---- sending.py: one attempt ----
    retryable_4xx: tuple[int, ...] = (408, 429)  # HTTP statuses: timeout / too many requests (routers): transient
    # s: how long a request waits for others to the same server to share its grouped request: the units of one
    # admission round (a prompt's n samples among them) reach here within a few event-loop turns of each other
    group_window_s: float = 0.002
    group_give_up: int = 3  # requests: grouped ones failing as a whole in a row, then one request each from then
    # s: a kept answer's chunk comes about this often (its server's time per token says how many tokens that is): an
    # actor killed mid-answer loses about half of it per unit in flight, and each chunk costs its parsing and one line
    # of the unit's progress file (the bench's keeping cost); engines/sglang.py's STREAM_MIN_TOKENS is the floor
    keep_every_s: float = 0.1
    prior_s_per_token: float = 0.02  # s/token: before a server has answered anything (a GPU decoding a full batch)
    # ---- admission.py: slots and rounds ----
    min_observations: int = 4  # answers: before a server's own token time replaces the prior
    p90_refresh: int = 32  # fraction: a full latency window is sorted again for its p90 after 1/32 of it is new
    answer_hold_s: float = 0.05  # s: longest an answered unit waits for the units admitted in its place to send
    # units: where servers take grouped requests (sending.py), freed slots are refilled in rounds of at least this
    # many, so the refills go out as one grouped request instead of one request each...
    round: int = 4
    # s: ...and a round waits at most this long for its slots, only while the servers have requests queued (their
    # running batch stays full meanwhile)
    round_hold_s: float = 0.25


SUPERVISION = Supervision()
