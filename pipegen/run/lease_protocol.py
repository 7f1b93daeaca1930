"""The lease protocol between a node runner (launch/node_runner.py) and its actors (actor/units.py) under
cluster=ray: HTTP on the node's loopback, JSON both ways.

- `POST /next {"actor": NAME, "want": K, "done": [keys]}` -> `{"units": [keys], "finished": bool}`: up to K
  unit keys (an empty list after a wait of a few seconds when the node has none); `finished` once the
  launcher has said the run needs nothing more from this node.
- `POST /done {"actor": NAME, "done": [keys]}`: units whose record (or failure record) is in a shard.

A unit is reported done only after the actor's shards were fsynced, so a completed lease is on disk.
Leases are never the record of what is done: the run directory is (a lost lease's units are re-derived from
the checkpoint and the shards).

Must never: import a role, or carry anything but unit keys.
"""

NEXT_PATH = "/next"
DONE_PATH = "/done"
