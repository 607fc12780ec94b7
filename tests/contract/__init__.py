"""Contract suites: one behaviour run against every implementation of a kind (the rendezvous
backends: memory, c10d, etcd and sealed; the storages: memory, a directory, S3)."""
