"""Example verl tools shipped with pipegen.

Owns: ready-to-use `verl.tools.base_tool.BaseTool` subclasses that verl's `ToolAgentLoop` loads from a
tool config file (`actor_rollout_ref.rollout.multi_turn.tool_config_path`), e.g.
`conf/tools/calculator.yaml` for `pipegen.tools.calculator.CalculatorTool`.
Must never: import verl at package import time (the tool modules import it themselves), or run code
the model wrote (no eval/exec, no subprocesses, no network).
"""
