"""Per-step attention metadata shared by the torch reference ops and the Triton kernels.

Sequences of one step are packed prefills first, then decodes:
tokens ``[0, num_prefill_tokens)`` belong to the ``num_prefills`` prefill/extend
sequences (ragged, offsets in ``cu_seqlens_q``), tokens after that are one per
decode sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32: query offsets of the prefill part
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    max_query_len: int  # longest prefill query in this step (0 when none)
    max_seq_len: int  # longest context in this step

    @property
    def num_seqs(self) -> int:
        return self.num_prefills + self.num_decodes
