"""ContextSnapshotAgentLoop: verl's tool-calling loop that returns a trajectory per context snapshot.

A multi-trajectory agent loop. It runs verl's `ToolAgentLoop` unchanged and records the conversation as it
stands (prompt, every token so far, mask, logprobs) after every `snapshot_every`-th assistant turn (0: never by
count), and after an assistant turn that calls the tool named by `snapshot_on_tool` (e.g. `deleteContext`, as
the StateLM fork does), before that tool runs. `run()` returns the snapshots, oldest first, then the final
conversation, exactly what `ToolAgentLoop` returns. Each piece is marked as the fork marks it: `is_snapshot`
(false on the final one) and `snapshot_index` (0, 1, ... on the snapshots). Each snapshot is a complete,
token-exact trajectory: training on all of them weights every intermediate context, e.g. for per-turn credit
assignment or for loops that will later rewrite their context.

Register it through a verl agent-loop config (conf/agent_loops/examples.yaml):

    - name: context_snapshot_agent
      _target_: pipegen.agent_loops.snapshot.ContextSnapshotAgentLoop
      snapshot_every: 1        # extra keys reach the constructor
      # snapshot_on_tool: deleteContext

and select it with `actor_rollout_ref.rollout.agent.default_agent_loop=context_snapshot_agent` (or an
`agent_name` column). pipegen writes one record per unit holding all pieces; the writer makes one row per
piece with `trajectory` = 0, 1, ...; each is scored by the run's `rows.reward` rule (docs/outputs.md:
Several trajectories per sample).

Owns: the snapshot bookkeeping on top of ToolAgentLoop's state machine.
Must never: re-tokenize (snapshots are slices of the loop's own token lists), or change what
ToolAgentLoop sends to the server.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop


class ContextSnapshotAgentLoop(ToolAgentLoop):
    def __init__(self, *args, snapshot_every: int = 1, snapshot_on_tool: str | None = None, **kwargs):
        kwargs.pop("name", None)  # the registry entry's own name, passed along by hydra.instantiate
        super().__init__(*args, **kwargs)
        if int(snapshot_every) < 0:
            raise ValueError(f"snapshot_every={snapshot_every}: must be 0 (never by count) or more")
        if snapshot_on_tool is not None and snapshot_on_tool not in self.tools:
            raise ValueError(f"snapshot_on_tool={snapshot_on_tool}: no such tool; the loop's tools are "
                             f"{sorted(self.tools)} (actor_rollout_ref.rollout.multi_turn.tool_config_path)")
        self.snapshot_every = int(snapshot_every)
        self.snapshot_on_tool = snapshot_on_tool
        self._snapshots: list[AgentLoopOutput] = []
        self._turns = 0

    async def _handle_generating_state(self, agent_data, sampling_params: dict[str, Any],
                                       ignore_termination: bool = False) -> AgentState:
        state = await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        self._turns = turns = agent_data.assistant_turns
        by_count = self.snapshot_every and turns % self.snapshot_every == 0 and state != AgentState.TERMINATED
        # the tool has not run yet (PROCESSING_TOOLS comes next): the snapshot is the context before its effect
        by_tool = state == AgentState.PROCESSING_TOOLS and any(
            call.name == self.snapshot_on_tool for call in agent_data.tool_calls[: self.max_parallel_calls])
        if by_count or by_tool:
            self._snapshots.append(self._snapshot(agent_data))
        return state

    def _snapshot(self, agent_data) -> AgentLoopOutput:
        """The trajectory as it stands right after an assistant turn (what run() would return now)."""
        n_resp = len(agent_data.response_mask)
        full = list(agent_data.prompt_ids)
        prompt_ids = full[: len(full) - n_resp]
        response_ids = full[len(full) - n_resp:] if n_resp else []
        logprobs = list(agent_data.response_logprobs) if agent_data.response_logprobs else None
        extra = {k: v for k, v in agent_data.extra_fields.items()}
        extra.update(turn_scores=list(agent_data.turn_scores), tool_rewards=list(agent_data.tool_rewards),
                     snapshot_turn=agent_data.assistant_turns)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[: self.response_length],
            response_mask=list(agent_data.response_mask)[: self.response_length],
            response_logprobs=logprobs[: self.response_length] if logprobs is not None else None,
            multi_modal_data={},
            num_turns=agent_data.user_turns + agent_data.assistant_turns + 1,
            metrics=AgentLoopMetrics(**{k: v for k, v in agent_data.metrics.items()
                                        if k in AgentLoopMetrics.model_fields}),
            extra_fields=extra,
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> list[AgentLoopOutput]:
        self._snapshots, self._turns = [], 0
        final = await super().run(sampling_params, **kwargs)
        final.extra_fields["snapshot_turn"] = self._turns
        snapshots = self._snapshots
        if snapshots and snapshots[-1].extra_fields["snapshot_turn"] == self._turns:
            snapshots = snapshots[:-1]  # ended while adding a tool response: the final output is that snapshot
        for i, snapshot in enumerate(snapshots):
            snapshot.extra_fields.update(is_snapshot=True, snapshot_index=i)
        final.extra_fields.update(is_snapshot=False, snapshot_index=None)
        # the terminal state's own output is the last trajectory (identical to ToolAgentLoop's result)
        return [*snapshots, final]
