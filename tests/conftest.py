"""Shared test setup.

TRITON_INTERPRET must be set before any module defining a @triton.jit kernel is
imported: this machine has no GPU, so Triton runs in its interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
