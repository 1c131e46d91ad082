"""`search-qa`: multi-hop questions over a bundled fictional encyclopedia (see env.py)."""
