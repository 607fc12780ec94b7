"""The worker library: what training scripts import (never imports the agent or the CLI)."""

__all__: list[str] = []
