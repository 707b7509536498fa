"""Side-by-side measurement scripts for fxdp (run them; they are not tests)."""
