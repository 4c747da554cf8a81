"""Former home of the Hugging Face swap, as the README documented it until the moe/ move:
`from moe.swap import save_hf`, `moe.swap.load_moefied(dir)`. The code lives in moe/hf/
(swap.py, export.py); this alias keeps scripts written from the old README working."""
from .hf import load_moefied, moefy, save_hf, supported_families

__all__ = ["moefy", "load_moefied", "save_hf", "supported_families"]
