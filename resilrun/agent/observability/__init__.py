"""What the agent records of the job: the event log (``events``), the counters and phases every
part reports into (``telemetry``) and their Prometheus export (``metrics``). Every group above
reports here; nothing here decides."""
