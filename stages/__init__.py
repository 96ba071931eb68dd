"""mtbert pipeline stages: one module per DVC stage."""
