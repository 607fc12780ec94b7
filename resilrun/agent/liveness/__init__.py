"""This node's own liveness as the others see it: the heartbeat it sends and reads
(``heartbeat``) and the lease that fences its writes to the persistent tier (``fence``)."""
