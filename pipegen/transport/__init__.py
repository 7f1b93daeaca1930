"""The run's network transports: the clients that carry what run/ defines, so that run/ imports none of them.

`redis_medium` (streams=redis: the run's lines through Redis streams, run/medium.py's plug-in).
Nothing here imports a role (launch, actor, writer, export): the roles and the readers import it.
"""
