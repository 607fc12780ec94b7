"""Captured checkpoint folders: files an unmodified script writes, kept in node memory, on peers and
in storage (issue 45)."""
