"""The job's status in the rendezvous store: the records agents write and the view ``status`` reads.

Light on purpose (no torch, no agent): ``resilrun status`` imports only this package and a store
client, so it answers in well under a second.
"""

from resilrun.status.view import SCHEMA, compose, read_raw

__all__ = ["SCHEMA", "compose", "read_raw"]
