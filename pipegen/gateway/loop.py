"""The verl agent loop `external`: one unit = one run of the user's harness against a gateway session.

Selected like any verl loop: per row through `agent_name: external`, or for every row with
`actor_rollout_ref.rollout.agent.default_agent_loop=external`; configured by `external.*`. Per unit it opens
a session on the actor's gateway (http_server.py), runs the harness with the session's URL and key (harness.py),
closes the session (later calls are refused), and returns the session's trajectories as verl's
`AgentLoopOutput`s, the most recently extended last (the one a task's reward scores; rollout.py copies the
reward to the others). The unit's record is then one shard line, written by rollout.py like any unit's: a unit
is exactly-once because its line is.

A harness that crashes, runs past `external.timeout_s`, returns something that is not a result, or never calls
the gateway raises `HarnessFailed`: the unit goes to the failures stream with the reason, never as a sample.

Owns: a unit's session from open to close, its trajectories as AgentLoopOutputs, the harness's reward.
Must never: write a trajectory the session did not record, or run without pipegen's server manager (the
session generates through it: the actor's engines, admission and retries; seam.py's `UnitServer`).
"""

from __future__ import annotations

from typing import Any

import orjson
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.experimental.agent_loop.tool_parser import ToolParser

from pipegen.gateway.harness import Harness, HarnessFailed
from pipegen.gateway.seam import UnitServer
from pipegen.gateway.session import Generated, Renderer, Session, Trajectory

GATEWAY_FIELD = "gateway"  # extra_fields key: how the trajectory came to be (branch reason, calls, its messages)
RESULT_FIELD = "harness_result"  # extra_fields key: the harness's result fields besides its reward


@register("external")
class ExternalAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.pop("name", None)
        super().__init__(*args, **kwargs)
        self.harness = Harness.from_config(self.config.external)
        fmt = self.rollout_config.multi_turn.format
        self.tool_parser = ToolParser.get_tool_parser(fmt, self.tokenizer) if fmt else None

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        manager = self.server_manager
        if not isinstance(manager, UnitServer):
            raise RuntimeError("the external agent loop runs inside pipegen's actors (it needs their gateway)")
        gateway = manager.gateway
        await gateway.start()
        renderer = Renderer(self.continuous_token_builder, self.tool_parser, self.tokenizer)

        async def generate(prompt_ids: list[int], params: dict[str, Any], seed: int | None) -> Generated:
            return await manager.generate_seeded(f"gw{id(params):x}", prompt_ids, params, seed)

        session = gateway.open(lambda sid, key: Session(
            sid, key, renderer, generate, dict(sampling_params), manager.sampling_seed,
            int(self.rollout_config.prompt_length), int(self.rollout_config.response_length)))
        row = orjson.loads(orjson.dumps(kwargs, default=str, option=orjson.OPT_SERIALIZE_NUMPY))
        try:
            result = await self.harness.run(row, gateway.base_url(session), session.key)
        except HarnessFailed as e:  # named with the gateway's last refusal, which the harness may have swallowed
            refusal = f"; the gateway's last refusal: {session.last_refusal}" if session.last_refusal else ""
            raise HarnessFailed(f"{e}{refusal}") from e
        finally:
            gateway.finish(session)
        if not session.trajectories:
            why = (f"the harness finished with no call answered: the gateway's last refusal: {session.last_refusal}"
                   if session.last_refusal else
                   "the harness finished without calling the gateway (no trajectory to record)")
            raise HarnessFailed(f"{why}{result.stderr}")
        outputs = [self._output(t, session) for t in sorted(session.trajectories, key=lambda t: t.last_used)]
        for out in outputs:
            if result.reward is not None:
                out.reward_score = result.reward
            if result.fields:
                out.extra_fields[RESULT_FIELD] = result.fields
        return outputs

    def _output(self, t: Trajectory, session: Session) -> AgentLoopOutput:
        return AgentLoopOutput(
            prompt_ids=t.prompt_ids,
            response_ids=t.response_ids,
            response_mask=t.mask,
            response_logprobs=t.logprobs if session.with_logprobs else None,
            multi_modal_data={},
            num_turns=sum(m["role"] != "system" for m in t.messages) + 1,
            metrics=AgentLoopMetrics(generate_sequences=session.generate_s),
            # the messages as the harness held them after the last call: the ATIF export's steps (export/atif.py)
            extra_fields={GATEWAY_FIELD: {"trajectory": t.number, "branch": t.branch, "calls": t.calls,
                                          "unparsed_tool_calls": t.unparsed_tool_calls,
                                          "retries_answered": session.retries_answered, "messages": t.messages}},
        )
