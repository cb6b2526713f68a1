"""The host side of runs and the code their ranks run: ``spawn`` (N local ranks: file rendezvous,
hard timeouts, tracebacks reported), ``smoke`` / ``smoke_rank`` (`shardkit smoke`), ``preflight`` /
``preflight_rank`` (`shardkit preflight CONFIG`), ``launcher`` (`shardkit launch`: deepspeed,
torchrun, accelerate launch), ``accelerate_config`` (the config an ``accelerate launch`` line will
use) and ``autopreflight/`` (the preflight `shardkit launch` puts into every rank)."""
