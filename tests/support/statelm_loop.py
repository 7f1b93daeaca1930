"""A user's agent loop written the way the StateLM fork writes one, for pipegen to run unchanged: the model manages
its context with a `deleteContext` tool; before each deletion the loop keeps a snapshot of the conversation, and
`run()` returns the fork's own wrapper, `MultiTrajectoryAgentLoopOutput(trajectories=[*snapshots, final])` (a
plain `AgentLoopOutput` when no snapshot was taken), each piece marked `is_snapshot` / `snapshot_index`.

pipegen imports nothing of this: the tests put its folder on PYTHONPATH and register it through
`actor_rollout_ref.rollout.agent.agent_loop_config_path`, as a user would. Here the tool returns a short text and
leaves the tokens as they are (the fake server's script answers by the number of assistant turns); the fork's
rewrite of the context is not what pipegen's rows depend on.
"""

from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from pydantic import BaseModel
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

DELETE_CONTEXT = "deleteContext"


class MultiTrajectoryAgentLoopOutput(BaseModel):
    """The fork's class: a snapshot taken before each deletion, then the final trajectory."""

    trajectories: list[AgentLoopOutput]


class DeleteContextTool(BaseTool):
    """`deleteContext(msg_id)`: answers "deleted <msg_id>" (the fork drops that message from the context)."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        super().__init__(config or {}, tool_schema)

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=f"deleted {parameters.get('msg_id')}"), 0.0, {}


TOOL_CONFIG = f"""tools:
  - class_name: statelm_loop.DeleteContextTool
    config: {{type: native}}
    tool_schema:
      type: function
      function:
        name: {DELETE_CONTEXT}
        description: "Delete a message from your context."
        parameters:
          type: object
          properties:
            msg_id: {{type: integer, description: "the message to delete"}}
          required: [msg_id]
"""


class StateLMAgentLoop(ToolAgentLoop):
    """verl's tool loop with the fork's snapshots: one before every deleteContext call runs."""

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)
        super().__init__(*args, **kwargs)
        self.trajectory_snapshots: list[AgentLoopOutput] = []

    async def _handle_processing_tools_state(self, agent_data) -> AgentState:
        if any(call.name == DELETE_CONTEXT for call in agent_data.tool_calls):
            self.trajectory_snapshots.append(self._snapshot(agent_data))
        return await super()._handle_processing_tools_state(agent_data)

    def _snapshot(self, agent_data) -> AgentLoopOutput:
        n = len(agent_data.response_mask)
        ids = list(agent_data.prompt_ids)
        logprobs = list(agent_data.response_logprobs) if agent_data.response_logprobs else None
        return AgentLoopOutput(
            prompt_ids=ids[: len(ids) - n], response_ids=ids[len(ids) - n:][: self.response_length],
            response_mask=list(agent_data.response_mask)[: self.response_length],
            response_logprobs=logprobs[: self.response_length] if logprobs is not None else None,
            num_turns=agent_data.user_turns + agent_data.assistant_turns + 1,
            metrics=AgentLoopMetrics(**{k: v for k, v in agent_data.metrics.items()
                                        if k in AgentLoopMetrics.model_fields}),
            extra_fields={"is_snapshot": True, "snapshot_index": len(self.trajectory_snapshots)},
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        self.trajectory_snapshots = []
        final = await super().run(sampling_params, **kwargs)
        final.extra_fields["is_snapshot"] = False
        if not self.trajectory_snapshots:
            return final
        return MultiTrajectoryAgentLoopOutput(trajectories=[*self.trajectory_snapshots, final])
