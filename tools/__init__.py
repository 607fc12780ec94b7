"""Development tools run from a checkout (``python -m tools.docgen``), never installed with resilrun."""
