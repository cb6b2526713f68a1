"""DeepSpeed ZeRO-1/2 checkpoints: one ``mp_rank_00_model_states.pt`` holding the full 16-bit module and one
``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank, opened and checked by ``reader``
(``readers.zero12`` describes them; ``writers.zero12`` writes them at any world size)."""
