"""Socket tests: one part of resilrun (the worker channel, the replica server and replicator, an
etcd or S3 client) driven over real sockets and processes. Suites run against every backend of
a kind are in tests/contract/."""
