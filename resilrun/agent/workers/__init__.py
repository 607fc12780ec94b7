"""This node's worker processes: how they are specified and started (``specs``, ``procs``), the
one place the channel's threads and the supervisor meet (``control``), and how a worker's failure
is read from its exit and error file (``failures``). The bottom of the agent: imports no other
group."""
