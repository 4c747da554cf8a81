"""Old path of moe/chunked_a2a.py (the chunked all-to-all overlap), kept for compatibility."""
from .chunked_a2a import *  # noqa: F401,F403
from .chunked_a2a import __all__, chunk_tables, overlapped_experts  # noqa: F401
