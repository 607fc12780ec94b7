"""The round loop and the parts it composes: the loop (``supervisor``) with its pure decision
(``policy``), the node's place in the job (``rounds``), and one module per thing it acts on: hot
spares, hung or raising workers, lost nodes, in-process recovery, spare nodes, the round's
master, the exit barrier and restarts. The top of the agent below its composition root."""
