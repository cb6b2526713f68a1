"""DeepSpeed ZeRO-1/2 checkpoints: one ``mp_rank_00_model_states.pt`` holding the full 16-bit module and one
``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank, named in ``files``
(``readers.zero12`` opens, checks and describes them; ``writers.zero12`` writes them at any world size)."""
