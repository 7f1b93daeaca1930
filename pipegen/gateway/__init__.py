"""The gateway: agents written outside verl (any harness that speaks OpenAI's or Anthropic's HTTP API) generate
through pipegen's engines, and every conversation becomes a token-exact verl trajectory.

It runs inside each actor process, on loopback, and only for runs that use the `external` agent loop:
- `loop.py`: the verl agent loop `external` (per unit: open a session, run the harness, return its
  trajectories);
- `harness.py`: running the user's harness (`external.harness=module:function`, a file's `path/to/file.py:function`, or
  `external.command=...`),
  its time limit, its result, its failure reasons;
- `http_server.py`: the aiohttp server (`/s/<session>/v1/...`), who gets in (session id + key), the three dialects'
  routes, a retry's headers handed to its session;
- `session.py`: one unit's conversations as trajectories (continue, fork, branch), retries answered from the
  first reply, generation through the unit's server manager (the actor's pool and admission: every engine works);
- `seam.py`: what the loop needs of that server manager (`UnitServer`, a Protocol the actor satisfies);
- `dialects/`: OpenAI chat completions, OpenAI responses and Anthropic messages, one module each, to and from
  one `ChatRequest` / `Reply` (`dialects/shapes.py`; server-sent events included).

Must never: re-tokenize what a model sampled, reach an engine for a caller without the session's key, listen
beyond loopback unless told, or write a file of the run (the unit's record is rollout.py's).
"""
