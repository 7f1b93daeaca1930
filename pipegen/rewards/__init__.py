"""Rewards: what scores a finished trajectory, and where that runs.

`spec` (which reward a row gets: verl's default_compute_score, a function the verl way through
`custom_reward_function.path/.name/.reward_kwargs`, or an HTTP verifier at `reward.verifier_url`; a task's
own reward for its rows), `local` (a reward function loaded with verl's own loader, run in a process pool,
or inline once proven cheap), `verifier` (the HTTP verifier client: batched, retried, time-limited),
`batching` (what both share: many pending samples sent as one request), `protocol` (the verifier's
request and answer, one definition for the client and the server), `serve` (`python -m
pipegen.rewards.serve`: any verl-style reward function served as a verifier).

A reward that fails (a function that raises, a verifier that does not answer in time or at all) is
raised as `RewardFailure`: the unit becomes a FailureRecord naming it, never a sample with a made-up score.
"""

from pipegen.rewards.protocol import RewardFailure

__all__ = ["RewardFailure"]
