"""Portal views, one module per capability."""
