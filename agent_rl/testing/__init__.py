"""Test doubles, named as such: stand-ins for what cannot run here, used by tests and benchmarks,
never by the product's own code paths."""
