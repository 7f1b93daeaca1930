"""What an actor does: run verl agent loops for its share of the units and append one record each.

`worker` (the process: its shards and stats, its parts wired together), `units` (where its units come
from), `admission` (how many units run at once: slots, the hold, the clock deadlines, when the tail starts and a
request may be hedged; `concurrency`, the controller), `rollout` (one unit: dataset row -> verl agent loop ->
RolloutRecord), the request path as verl's server manager: `attempts` (a generation's attempts: retries, stalls
judged by the engine's evidence, hedges), `routing` (which server), `sending` (one attempt over HTTP),
`limits` (the requests' limits), `supervision` (the request path's tuned numbers, each with its unit and why),
`readiness` (the start-up clock, the wait for the first server),
`continuation` (progress inside a sample: a long answer's kept tokens, a restarted unit's answers given again),
`scoring` (the row's reward, as verl's reward loop calls it: pipegen/rewards/), `loop_cache` (the verl agent
loop, built once per actor), `detokenize` (a response's text).
`python -m pipegen.actor output_dir=DIR rank=K` runs one actor.
"""
