"""The training state this node holds for its workers: the channel they commit and restore
through (``channel``), the tiers a restore reads (``tiers``), replication to peer nodes
(``replication``) and persistence to durable storage (``persister``)."""
