"""Code shared by the stages."""
