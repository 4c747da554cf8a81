"""Context parallelism: a sequence split over the cp ranks (split.py: the load-balanced chunk
order), attention over the split sequence by a ring of key/value blocks (ring.py) or by an
all-to-all into a head split (ulysses.py)."""
