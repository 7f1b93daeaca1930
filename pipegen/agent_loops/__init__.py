"""Example user agent loops, registered the verl way (`conf/agent_loops/examples.yaml` through
`actor_rollout_ref.rollout.agent.agent_loop_config_path`).

Owns: `snapshot.ContextSnapshotAgentLoop`, a multi-trajectory loop (one unit -> a list of
AgentLoopOutput) that pipegen's actor and writer turn into one row per trajectory.
Must never: import verl at package import time (each loop module does), or be needed by pipegen's own
code paths: these are examples of what users write.
"""
