"""The run's network transports: the clients that carry what run/ defines, so that run/ imports none of them.

`redis_medium` (streams=redis: the run's lines through Redis streams, run/medium.py's plug-in), `object_store` (the
one obstore client every store call goes through: retries, the lost-acknowledgement rule, the launch's refusals;
`SegmentFollower`), `store_read` (a store run read back into a local read cache for every reader: `StoreRun`).
Nothing here imports a role (launch, actor, writer, export): the roles and the readers import it.
"""
